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

// The block's scale byte and the factor its values are multiplied by, from vmax's BF16 bits.
inline float block_scale(std::uint32_t vmax_bits, const Nvfp4Cast& cast, const std::array<float, 256>& e4m3,
                         std::uint8_t* scale) {
  const float r6 = 1.0f / 6.0f;
  const float vmax = bf16_to_float(static_cast<std::uint16_t>(vmax_bits));
  if (cast.ue8m0) {
    const std::uint8_t sf = float_to_ue8m0_ceil(vmax * r6);
    *scale = sf;
    return sf == 0 ? 1.0f : std::ldexp(1.0f, 127 - static_cast<int>(sf));
  }
  const float gs = cast.global_scale;
  const std::uint8_t sf = float_to_fp8_e4m3(gs * (vmax * r6));
  *scale = sf;
  const float sf_q = e4m3[sf];
  return sf_q != 0.0f ? 1.0f / (sf_q * (1.0f / gs)) : 0.0f;
}

const E2M1Thresholds& thresholds(const Nvfp4Cast& cast) {
  return cast.rounding == E2M1Rounding::kNearestEven ? kNearestEvenThresholds : kSm90Thresholds;
}

void cast_row(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast, bool avx2, std::uint8_t* packed,
              std::uint8_t* scales) {
  (void)avx2;  // without MOE_EP_X86_DISPATCH
  const std::array<float, 256>& e4m3 = e4m3_values();
  const E2M1Thresholds& th = thresholds(cast);
  for (std::int64_t b = 0; b < hidden / 16; ++b) {
    const std::uint16_t* x = bf16 + b * 16;
    // max |x| over integer magnitude bits (their order is the floats' order), NaN ignored
    std::uint32_t vmax_bits = 0;
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t m = x[i] & 0x7fffu;
      vmax_bits = std::max(vmax_bits, m > 0x7f80u ? 0u : m);
    }
    const float out_scale = block_scale(vmax_bits, cast, e4m3, scales + b);
#ifdef MOE_EP_X86_DISPATCH
    if (avx2) {
      encode_block_avx2(x, out_scale, th, packed + b * 8);
      continue;
    }
#endif
    encode_block(x, out_scale, th, packed + b * 8);
  }
}

#ifdef MOE_EP_X86_DISPATCH
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() values, which -Wuninitialized
// reports where they are inlined (GCC bug 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MOE_EP_NVFP4_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq")))

// block_scale's E4M3 case for 16 blocks: float_to_fp8_e4m3's integer steps lane by lane, the
// table of its values gathered, the same FP32 products and quotient.
MOE_EP_NVFP4_AVX512 inline void e4m3_scales16(const std::uint32_t* vmax_bits, float gs,
                                              const std::array<float, 256>& e4m3, std::uint8_t* scales,
                                              float* out_scale) {
  const __m512 vmax = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(vmax_bits), 16));
  const __m512 f = _mm512_mul_ps(_mm512_set1_ps(gs), _mm512_mul_ps(vmax, _mm512_set1_ps(1.0f / 6.0f)));
  const __m512i u = _mm512_castps_si512(f);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(0x7ffff)), odd), 20);
  const __m512i normal = _mm512_sub_epi32(rounded, _mm512_set1_epi32(120 << 3));
  const __m512 scaled = _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(512.0f)),
                                      _mm512_set1_ps(8388608.0f));
  const __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(scaled), _mm512_set1_epi32(0x4b000000));
  __m512i code = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x3c800000)), subnormal);
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x43e00000)), _mm512_set1_epi32(0x7e));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f));
  const __m512i sf = _mm512_and_si512(_mm512_or_si512(sign, code), _mm512_set1_epi32(0xff));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_cvtepi32_epi8(sf));
  const __m512 sf_q = _mm512_i32gather_ps(sf, e4m3.data(), 4);
  const __m512 quotient = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(sf_q, _mm512_set1_ps(1.0f / gs)));
  _mm512_storeu_ps(out_scale, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sf_q, _mm512_setzero_ps(), _CMP_NEQ_UQ), quotient));
}

// Block b's 16 BF16 values, widened to 32-bit lanes.
MOE_EP_NVFP4_AVX512 inline __m512i load_block(const std::uint16_t* bf16, std::int64_t b) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16 + b * 16)));
}

// The whole row on AVX-512, in chunks of blocks: every block's maximum of the magnitude bits (NaN
// as 0), then the scales (16 at a time for E4M3), then every block's codes: encode_block's product,
// seven strict ordered comparisons and NaN rule; vpmovqb keeps the low byte of each 64-bit lane
// (codes 2i | 2i + 1 << 4). Short independent chains per block, which the CPU overlaps.
MOE_EP_NVFP4_AVX512 void cast_row_avx512(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast,
                                         std::uint8_t* packed, std::uint8_t* scales) {
  const std::array<float, 256>& e4m3 = e4m3_values();
  const E2M1Thresholds& th = thresholds(cast);
  __m512 t[7];
  for (int k = 0; k < 7; ++k) t[k] = _mm512_set1_ps(th.t[k]);
  const __m512i one = _mm512_set1_epi32(1), nan_code = _mm512_set1_epi32(7), sign = _mm512_set1_epi32(8);
  const __m512i abs_bf16 = _mm512_set1_epi32(0x7fff), bf16_inf = _mm512_set1_epi32(0x7f80);
  const __m512i abs_f32 = _mm512_set1_epi32(0x7fffffff), f32_inf = _mm512_set1_epi32(0x7f800000);
  constexpr std::int64_t kChunk = 64;
  std::uint32_t vmax_bits[kChunk];
  float out_scale[kChunk];
  for (std::int64_t first = 0; first < hidden / 16; first += kChunk) {
    const std::int64_t count = std::min(kChunk, hidden / 16 - first);
    for (std::int64_t i = 0; i < count; ++i) {
      const __m512i m16 = _mm512_and_si512(load_block(bf16, first + i), abs_bf16);
      vmax_bits[i] = _mm512_reduce_max_epu32(_mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(m16, bf16_inf), m16));
    }
    std::int64_t i = 0;
    if (!cast.ue8m0)
      for (; i + 16 <= count; i += 16)
        e4m3_scales16(vmax_bits + i, cast.global_scale, e4m3, scales + first + i, out_scale + i);
    for (; i < count; ++i) out_scale[i] = block_scale(vmax_bits[i], cast, e4m3, scales + first + i);
    for (i = 0; i < count; ++i) {
      const __m512i raw = load_block(bf16, first + i);
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512i u = _mm512_castps_si512(_mm512_mul_ps(x, _mm512_set1_ps(out_scale[i])));
      const __m512i magnitude = _mm512_and_si512(u, abs_f32);
      const __m512 m = _mm512_castsi512_ps(magnitude);
      __m512i code = _mm512_setzero_si512();
      for (int k = 0; k < 7; ++k) code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(m, t[k], _CMP_GT_OQ), code, one);
      code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(magnitude, f32_inf), nan_code);
      code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(u, 28), sign));
      const __m512i pairs = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(packed + (first + i) * 8), _mm512_cvtepi64_epi8(pairs));
    }
  }
}
#undef MOE_EP_NVFP4_AVX512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

}  // namespace

bool cast_row_nvfp4_on(Isa isa, const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast,
                       std::uint8_t* packed, std::uint8_t* scales) {
  switch (isa) {
    case Isa::kPortable:
      cast_row(bf16, hidden, cast, false, packed, scales);
      return true;
#ifdef MOE_EP_X86_DISPATCH
    case Isa::kAvx2:
      if (!has_avx2()) return false;
      cast_row(bf16, hidden, cast, true, packed, scales);
      return true;
    case Isa::kAvx512:
      if (!has_avx512()) return false;
      cast_row_avx512(bf16, hidden, cast, packed, scales);
      return true;
#endif
    default:
      return false;
  }
}

void cast_row_nvfp4(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast, std::uint8_t* packed,
                    std::uint8_t* scales) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx512()) return cast_row_avx512(bf16, hidden, cast, packed, scales);
  cast_row(bf16, hidden, cast, has_avx2(), packed, scales);
#else
  cast_row(bf16, hidden, cast, false, packed, scales);
#endif
}

}  // namespace moe_ep::core
