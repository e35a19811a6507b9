#include "core/nvfp4_rows.hh"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>

#include "core/cpu_features.hh"
#include "core/env_vars.hh"

namespace moe_ep::core {

E2M1Rounding nvfp4_rounding(std::optional<E2M1Rounding> asked) {
  if (asked) return *asked;
  return env::get(env::kNvfp4Rounding) == "sm90" ? E2M1Rounding::kSm90 : E2M1Rounding::kNearestEven;
}

namespace {

// The largest float below f (f > 0 and finite).
constexpr float below(float f) { return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) - 1u); }

// E2M1 magnitude index = the number of thresholds that |v| exceeds: float_to_e2m1's comparisons
// (`m >= t` is `m > below(t)`) as seven strict ones, branch-free, so that the loop over a block
// vectorises; NaN exceeds none and is mapped to 7 afterwards.
struct E2M1Thresholds {
  float t[7];
};
constexpr E2M1Thresholds kNearestEvenThresholds{{0.25f, below(0.75f), 1.25f, below(1.75f), 2.5f, below(3.5f), 5.0f}};
constexpr E2M1Thresholds kSm90Thresholds{
    {below(0.5f), below(1.0f), 1.41421356237309505f, below(2.0f), 2.82842712474619010f, below(4.0f), 5.65685424949238020f}};

// fp8_e4m3_to_float of every code, looked up once per block.
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int code = 0; code < 256; ++code) v[static_cast<size_t>(code)] = fp8_e4m3_to_float(static_cast<std::uint8_t>(code));
    return v;
  }();
  return values;
}

// The 16 values of one block times out_scale, as E2M1 codes packed two per byte.
inline void encode_block(const std::uint16_t* x, float out_scale, const E2M1Thresholds& th, std::uint8_t* packed) {
  std::uint32_t codes[16];
  for (int i = 0; i < 16; ++i) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(bf16_to_float(x[i]) * out_scale);
    const float m = std::bit_cast<float>(u & 0x7fffffffu);
    std::uint32_t code = 0;
    for (int k = 0; k < 7; ++k) code += m > th.t[k] ? 1u : 0u;
    code = (u & 0x7fffffffu) > 0x7f800000u ? 7u : code;  // NaN: magnitude 6
    codes[i] = code | ((u >> 28) & 0x8u);
  }
  for (int i = 0; i < 8; ++i) packed[i] = static_cast<std::uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
}

#ifdef MOE_EP_X86_DISPATCH
// encode_block on eight lanes at a time: the same FP32 product, the same seven strict comparisons
// (ordered, so NaN exceeds none), then two codes per byte from each 64-bit lane.
__attribute__((target("avx2"))) inline __m256i codes8(const std::uint16_t* x, __m256 scale, const E2M1Thresholds& th) {
  const __m256i raw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), scale));
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256 m = _mm256_castsi256_ps(magnitude);
  __m256i code = _mm256_setzero_si256();
  for (int k = 0; k < 7; ++k)  // a true comparison is -1
    code = _mm256_sub_epi32(code, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(th.t[k]), _CMP_GT_OQ)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(7), _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000)));
  code = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 28), _mm256_set1_epi32(8)));
  // Each 64-bit lane holds codes 2i (low) and 2i + 1 (high): their byte is low | high << 4.
  const __m256i pairs = _mm256_or_si256(code, _mm256_srli_epi64(code, 28));
  const __m256i first_bytes = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                               0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_shuffle_epi8(pairs, first_bytes);
}

__attribute__((target("avx2"))) void encode_block_avx2(const std::uint16_t* x, float out_scale, const E2M1Thresholds& th,
                                                       std::uint8_t* packed) {
  const __m256 scale = _mm256_set1_ps(out_scale);
  for (int half = 0; half < 2; ++half) {
    const __m256i bytes = codes8(x + 8 * half, scale, th);
    const auto low = static_cast<std::uint16_t>(_mm256_extract_epi16(bytes, 0));
    const auto high = static_cast<std::uint16_t>(_mm256_extract_epi16(bytes, 8));
    std::memcpy(packed + 4 * half, &low, 2);
    std::memcpy(packed + 4 * half + 2, &high, 2);
  }
}
#endif

}  // namespace

namespace {

void cast_row(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast, bool avx2, std::uint8_t* packed,
              std::uint8_t* scales) {
  (void)avx2;  // without MOE_EP_X86_DISPATCH
  const float r6 = 1.0f / 6.0f;
  const std::array<float, 256>& e4m3 = e4m3_values();
  const E2M1Thresholds& th = cast.rounding == E2M1Rounding::kNearestEven ? kNearestEvenThresholds : kSm90Thresholds;
  for (std::int64_t b = 0; b < hidden / 16; ++b) {
    const std::uint16_t* x = bf16 + b * 16;
    // max |x| over integer magnitude bits (their order is the floats' order), NaN ignored
    std::uint32_t vmax_bits = 0;
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t m = x[i] & 0x7fffu;
      vmax_bits = std::max(vmax_bits, m > 0x7f80u ? 0u : m);
    }
    const float vmax = bf16_to_float(static_cast<std::uint16_t>(vmax_bits));
    float out_scale;
    if (cast.ue8m0) {
      const std::uint8_t sf = float_to_ue8m0_ceil(vmax * r6);
      scales[b] = sf;
      out_scale = sf == 0 ? 1.0f : std::ldexp(1.0f, 127 - static_cast<int>(sf));
    } else {
      const float gs = cast.global_scale;
      const std::uint8_t sf = float_to_fp8_e4m3(gs * (vmax * r6));
      scales[b] = sf;
      const float sf_q = e4m3[sf];
      out_scale = sf_q != 0.0f ? 1.0f / (sf_q * (1.0f / gs)) : 0.0f;
    }
#ifdef MOE_EP_X86_DISPATCH
    if (avx2) {
      encode_block_avx2(x, out_scale, th, packed + b * 8);
      continue;
    }
#endif
    encode_block(x, out_scale, th, packed + b * 8);
  }
}

}  // namespace

void cast_row_nvfp4(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast, std::uint8_t* packed,
                    std::uint8_t* scales) {
#ifdef MOE_EP_X86_DISPATCH
  cast_row(bf16, hidden, cast, has_avx2(), packed, scales);
#else
  cast_row(bf16, hidden, cast, false, packed, scales);
#endif
}

void cast_row_nvfp4_generic(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast, std::uint8_t* packed,
                            std::uint8_t* scales) {
  cast_row(bf16, hidden, cast, false, packed, scales);
}

}  // namespace moe_ep::core
