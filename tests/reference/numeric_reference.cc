#include "reference/numeric_reference.hh"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace moe_ep::reference {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float float_of(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

std::uint16_t bf16_from_float(float f) {
  const std::uint32_t u = bits_of(f);
  const std::uint32_t exponent = (u >> 23) & 0xffu, mantissa = u & 0x7fffffu;
  if (exponent == 0xffu && mantissa != 0) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // NaN
  std::uint32_t kept = u >> 16;              // sign, exponent and the top 7 mantissa bits
  const std::uint32_t dropped = u & 0xffffu;  // compared with half of the last kept bit
  if (dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u) != 0)) ++kept;  // a carry may reach infinity
  return static_cast<std::uint16_t>(kept);
}

float float_from_bf16(std::uint16_t b) { return float_of(static_cast<std::uint32_t>(b) << 16); }

std::uint8_t fp8_e4m3_from_float(float f) {
  const std::uint32_t u = bits_of(f);
  const std::uint8_t sign = (u >> 31) != 0 ? 0x80 : 0x00;
  const std::uint32_t exponent = (u >> 23) & 0xffu, mantissa = u & 0x7fffffu;
  if (exponent == 0xffu) return static_cast<std::uint8_t>(sign | (mantissa != 0 ? 0x7f : 0x7e));  // NaN; infinity saturates
  // |f| = significand * 2^power with an integer significand (FP32 subnormals included).
  const std::uint64_t significand = exponent == 0 ? mantissa : (mantissa | 0x800000u);
  const int power = exponent == 0 ? -149 : static_cast<int>(exponent) - 150;
  if (significand == 0) return sign;
  int top = 63;
  while (((significand >> top) & 1u) == 0) --top;
  // The binade of |f| is [2^b, 2^(b+1)), b = power + top. E4M3's biased exponent there is b + 7;
  // below the smallest normal binade (b + 7 < 1) the subnormal grid continues with step 2^-9.
  const int biased = std::max(power + top + 7, 1);
  const int step_power = biased - 10;  // 3 mantissa bits: step = 2^(binade - 3)
  // steps = |f| / 2^step_power, rounded to nearest, ties to even.
  const int shift = step_power - power;
  std::uint64_t steps;
  if (shift <= 0) {
    steps = significand << -shift;
  } else if (shift > 62) {
    steps = 0;  // far below half a step
  } else {
    steps = significand >> shift;
    const std::uint64_t rest = significand & ((std::uint64_t{1} << shift) - 1);
    const std::uint64_t half = std::uint64_t{1} << (shift - 1);
    if (rest > half || (rest == half && (steps & 1u) != 0)) ++steps;
  }
  // steps is in [8, 16] for a normal binade (16: the rounding carried into the next binade) and
  // in [0, 8] on the subnormal grid; both map to code (biased - 1) * 8 + steps.
  const std::int64_t code = static_cast<std::int64_t>(biased - 1) * 8 + static_cast<std::int64_t>(steps);
  return static_cast<std::uint8_t>(sign | (code > 0x7e ? 0x7e : code));  // saturate at 448
}

double fp8_e4m3_value(std::uint8_t code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  if (e == 0xf && m == 7) return std::nan("");
  const double magnitude = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

namespace {

constexpr int kBlock = 128;
constexpr float kE4M3Max = 448.0f;
constexpr float kE4M3MaxInv = 1.0f / 448.0f;  // DeepEP's FP32 constant kFP8AmaxInv
constexpr float kAmaxFloor = 1e-4f;

}  // namespace

Fp8Row quantize_row_fp8(const float* x, int hidden, bool round_scale, bool ue8m0) {
  const int blocks = hidden / kBlock;
  Fp8Row out;
  out.codes.resize(static_cast<std::size_t>(hidden));
  out.scales.assign(static_cast<std::size_t>(ue8m0 ? (blocks + 3) / 4 : blocks), 0u);
  for (int b = 0; b < blocks; ++b) {
    float amax = 0.0f;
    for (int i = b * kBlock; i < (b + 1) * kBlock; ++i)
      if (!std::isnan(x[i]) && std::fabs(x[i]) > amax) amax = std::fabs(x[i]);
    if (amax < kAmaxFloor) amax = kAmaxFloor;
    const float product = amax * kE4M3MaxInv;  // one FP32 product, as DeepEP's kernel
    float scale_inv = product, multiplier = kE4M3Max / amax;
    if (round_scale && std::isfinite(product)) {
      int e = 0;
      const float m = std::frexp(product, &e);  // product = m * 2^e, m in [0.5, 1)
      const int up = m == 0.5f ? e - 1 : e;     // ceil(log2(product))
      scale_inv = std::ldexp(1.0f, up);
      multiplier = std::ldexp(1.0f, -up);
    }
    for (int i = b * kBlock; i < (b + 1) * kBlock; ++i)
      out.codes[static_cast<std::size_t>(i)] = fp8_e4m3_from_float(x[i] * multiplier);
    if (ue8m0) {
      const std::uint32_t exponent_byte = (bits_of(scale_inv) >> 23) & 0xffu;
      out.scales[static_cast<std::size_t>(b / 4)] |= exponent_byte << (8 * (b % 4));
    } else {
      out.scales[static_cast<std::size_t>(b)] = bits_of(scale_inv);
    }
  }
  return out;
}

Fp8Row quantize_row_fp8(const std::uint16_t* bf16, int hidden, bool round_scale, bool ue8m0) {
  std::vector<float> values(static_cast<std::size_t>(hidden));
  for (int i = 0; i < hidden; ++i) values[static_cast<std::size_t>(i)] = float_from_bf16(bf16[i]);
  return quantize_row_fp8(values.data(), hidden, round_scale, ue8m0);
}

}  // namespace moe_ep::reference

namespace moe_ep::reference {

double e2m1_value(std::uint8_t code) {
  static const double kMagnitudes[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const double v = kMagnitudes[code & 7];
  return (code & 8) ? -v : v;
}

std::uint8_t e2m1_from_float(float f, bool sm90) {
  const std::uint8_t sign = (bits_of(f) >> 31) ? 8 : 0;
  const double m = std::fabs(static_cast<double>(f));
  if (std::isnan(f) || m > 6) return static_cast<std::uint8_t>(sign | 7);  // NaN, saturation, infinity
  if (sm90) {
    const double r2 = static_cast<double>(static_cast<float>(std::sqrt(2.0)));
    const double r8 = static_cast<double>(static_cast<float>(2.0 * std::sqrt(2.0)));
    const double r32 = static_cast<double>(static_cast<float>(4.0 * std::sqrt(2.0)));
    int k;
    if (m < 0.5) k = 0;
    else if (m < 1) k = 1;
    else if (m < 2) k = m > r2 ? 3 : 2;
    else if (m < 4) k = m > r8 ? 5 : 4;
    else k = m > r32 ? 7 : 6;
    return static_cast<std::uint8_t>(sign | k);
  }
  int best = 0;
  double best_distance = std::fabs(m - e2m1_value(0));
  for (int k = 1; k < 8; ++k) {
    const double d = std::fabs(m - e2m1_value(static_cast<std::uint8_t>(k)));
    if (d < best_distance || (d == best_distance && k % 2 == 0)) {
      best = k;
      best_distance = d;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

std::uint8_t ue8m0_ceil_from_float(float f) {
  if (std::isnan(f) || f < 0) return 255;
  for (int b = 0; b <= 254; ++b)
    if (std::ldexp(1.0, b - 127) >= static_cast<double>(f)) return static_cast<std::uint8_t>(b);
  return 254;
}

}  // namespace moe_ep::reference

namespace moe_ep::reference {

Nvfp4Row quantize_row_nvfp4(const std::uint16_t* bf16, int hidden, float global_scale, bool ue8m0, bool sm90) {
  Nvfp4Row row;
  row.packed.assign(static_cast<size_t>(hidden / 2), 0);
  row.scales.assign(static_cast<size_t>(hidden / 16), 0);
  const float sixth = static_cast<float>(1.0 / 6.0);
  for (int b = 0; b < hidden / 16; ++b) {
    float vmax = 0;
    for (int i = 0; i < 16; ++i) {
      const float v = std::fabs(float_from_bf16(bf16[b * 16 + i]));
      if (!std::isnan(v)) vmax = std::max(vmax, v);
    }
    const float base = vmax * sixth;
    float out_scale;
    if (ue8m0) {
      const std::uint8_t sf = ue8m0_ceil_from_float(base);
      row.scales[static_cast<size_t>(b)] = sf;
      out_scale = sf == 0 ? 1.0f : static_cast<float>(std::ldexp(1.0, 127 - sf));
    } else {
      const float scaled = global_scale * base;
      const std::uint8_t sf = fp8_e4m3_from_float(scaled);
      row.scales[static_cast<size_t>(b)] = sf;
      const float value = static_cast<float>(fp8_e4m3_value(sf));
      const float inverse_gs = 1.0f / global_scale;
      const float denominator = value * inverse_gs;
      out_scale = value != 0 ? 1.0f / denominator : 0.0f;
    }
    for (int i = 0; i < 16; ++i) {
      const float v = float_from_bf16(bf16[b * 16 + i]) * out_scale;
      const std::uint8_t code = e2m1_from_float(v, sm90);
      row.packed[static_cast<size_t>(b * 8 + i / 2)] |= static_cast<std::uint8_t>(i % 2 ? code << 4 : code);
    }
  }
  return row;
}

}  // namespace moe_ep::reference
