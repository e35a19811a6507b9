#include "core/nvfp4_rows.hh"

#include <cmath>

#include "core/env_vars.hh"

namespace moe_ep::core {

E2M1Rounding nvfp4_rounding(std::optional<E2M1Rounding> asked) {
  if (asked) return *asked;
  return env::get(env::kNvfp4Rounding) == "sm90" ? E2M1Rounding::kSm90 : E2M1Rounding::kNearestEven;
}

void cast_row_nvfp4(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast, std::uint8_t* packed,
                    std::uint8_t* scales) {
  const float r6 = 1.0f / 6.0f;
  for (std::int64_t b = 0; b < hidden / 16; ++b) {
    const std::uint16_t* x = bf16 + b * 16;
    float vmax = 0.0f;
    for (int i = 0; i < 16; ++i) {
      const float a = std::fabs(bf16_to_float(x[i]));
      if (a > vmax) vmax = a;  // NaN never compares greater: ignored
    }
    float out_scale;
    if (cast.ue8m0) {
      const std::uint8_t sf = float_to_ue8m0_ceil(vmax * r6);
      scales[b] = sf;
      out_scale = sf == 0 ? 1.0f : std::ldexp(1.0f, 127 - static_cast<int>(sf));
    } else {
      const float gs = cast.global_scale;
      const std::uint8_t sf = float_to_fp8_e4m3(gs * (vmax * r6));
      scales[b] = sf;
      const float sf_q = fp8_e4m3_to_float(sf);
      out_scale = sf_q != 0.0f ? 1.0f / (sf_q * (1.0f / gs)) : 0.0f;
    }
    for (int i = 0; i < 16; i += 2) {
      const std::uint8_t lo = float_to_e2m1(bf16_to_float(x[i]) * out_scale, cast.rounding);
      const std::uint8_t hi = float_to_e2m1(bf16_to_float(x[i + 1]) * out_scale, cast.rounding);
      packed[b * 8 + i / 2] = static_cast<std::uint8_t>(lo | (hi << 4));
    }
  }
}

}  // namespace moe_ep::core
