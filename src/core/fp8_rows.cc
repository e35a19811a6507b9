#include "core/fp8_rows.hh"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cpu_features.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/dtype.hpp"

namespace moe_ep::core {
namespace {

// DeepEP's FP32 constant 1 / 448 (0x3B124925): the scale is amax times it, not amax / 448, which
// differs in the last bit for about half of the BF16 values.
constexpr float kFp8E4M3MaxInv = 1.0f / kFp8E4M3Max;

// 2^e as an FP32 from its exponent field; e in [-126, 127].
inline float power_of_two(int e) { return bits_float(static_cast<std::uint32_t>(e + 127) << 23); }

// |x| as ordered integer bits, NaN as zero (ignored by the maximum).
inline std::uint32_t magnitude_bits(std::uint16_t b) {
  const std::uint32_t m = b & 0x7fffu;
  return m > 0x7f80u ? 0u : m << 16;
}
inline std::uint32_t magnitude_bits(float f) {
  const std::uint32_t m = float_bits(f) & 0x7fffffffu;
  return m > 0x7f800000u ? 0u : m;
}
inline float widen(std::uint16_t b) { return bf16_to_float(b); }
inline float widen(float f) { return f; }

inline Fp8BlockScales block_scale(std::uint32_t amax_bits, bool round_scale) {
  return fp8_block_scales(bits_float(amax_bits), round_scale);
}

inline void store_scale(std::byte* scales, std::int64_t b, float scale_inv, bool ue8m0) {
  if (ue8m0) {
    reinterpret_cast<std::uint8_t*>(scales)[b] = static_cast<std::uint8_t>(float_bits(scale_inv) >> 23);
  } else {
    std::memcpy(scales + 4 * b, &scale_inv, 4);
  }
}

template <class T>
void cast_generic(const T* x, std::int64_t hidden, bool round_scale, bool ue8m0, std::uint8_t* q, std::byte* scales) {
  for (std::int64_t b = 0; b < hidden / kFp8BlockSize; ++b) {
    const T* in = x + b * kFp8BlockSize;
    std::uint8_t* out = q + b * kFp8BlockSize;
    std::uint32_t amax_bits = 0;
    for (int i = 0; i < kFp8BlockSize; ++i) amax_bits = std::max(amax_bits, magnitude_bits(in[i]));
    const Fp8BlockScales s = block_scale(amax_bits, round_scale);
    for (int i = 0; i < kFp8BlockSize; ++i) out[i] = float_to_fp8_e4m3(widen(in[i]) * s.scale);
    store_scale(scales, b, s.scale_inv, ue8m0);
  }
}

#ifdef MOE_EP_X86_DISPATCH
// AVX2: the same integer maximum and the same FP32 product per element, then the selects of
// float_to_fp8_e4m3 on eight lanes at a time.
__attribute__((target("avx2"))) inline __m256i encode8(const std::uint16_t* p, __m256 scale) {
  const __m256i raw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), scale);
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(0x7ffff)), lsb), 20),
      _mm256_set1_epi32(120 << 3));
  const __m256 sub_f = _mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(512.0f)),
                                     _mm256_set1_ps(8388608.0f));
  const __m256i subnormal = _mm256_sub_epi32(_mm256_castps_si256(sub_f), _mm256_set1_epi32(0x4b000000));
  __m256i code = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), mag));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7e), _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x43e00000)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000)));
  return _mm256_or_si256(code, sign);
}

__attribute__((target("avx2"))) void cast_bf16_avx2(const std::uint16_t* x, std::int64_t hidden, bool round_scale,
                                                    bool ue8m0, std::uint8_t* q, std::byte* scales) {
  const __m256i no_sign = _mm256_set1_epi16(0x7fff), inf = _mm256_set1_epi16(0x7f80);
  for (std::int64_t b = 0; b < hidden / kFp8BlockSize; ++b) {
    const std::uint16_t* in = x + b * kFp8BlockSize;
    __m256i amax = _mm256_setzero_si256();
    for (int i = 0; i < kFp8BlockSize; i += 16) {
      const __m256i m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)), no_sign);
      amax = _mm256_max_epu16(amax, _mm256_andnot_si256(_mm256_cmpgt_epi16(m, inf), m));  // NaN -> 0
    }
    alignas(32) std::uint16_t lanes[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), amax);
    const std::uint32_t amax_bits = static_cast<std::uint32_t>(*std::max_element(lanes, lanes + 16)) << 16;
    const Fp8BlockScales s = block_scale(amax_bits, round_scale);
    const __m256 scale = _mm256_set1_ps(s.scale);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < kFp8BlockSize; i += 32) {
      // packus interleaves 128-bit lanes: [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7]; the
      // permute restores element order.
      const __m256i ab = _mm256_packus_epi32(encode8(in + i, scale), encode8(in + i + 8, scale));
      const __m256i cd = _mm256_packus_epi32(encode8(in + i + 16, scale), encode8(in + i + 24, scale));
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kFp8BlockSize + i), bytes);
    }
    store_scale(scales, b, s.scale_inv, ue8m0);
  }
}

// AVX-512: encode8's steps on sixteen lanes, with mask registers for the selects; the codes
// (0..255 in each 32-bit lane) narrow to bytes in element order (vpmovdb). GCC 12's AVX-512
// intrinsics start from _mm512_undefined_*() values, which -Wuninitialized reports where they are
// inlined (GCC bug 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MOE_EP_FP8_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq")))
MOE_EP_FP8_AVX512 inline __m128i encode16(const std::uint16_t* p, __m512 scale) {
  const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), scale));
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(0x7ffff)), lsb), 20),
      _mm512_set1_epi32(120 << 3));
  const __m512 sub_f = _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(512.0f)),
                                     _mm512_set1_ps(8388608.0f));
  const __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(sub_f), _mm512_set1_epi32(0x4b000000));
  __m512i code =
      _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x3c800000), mag), normal, subnormal);
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x43e00000)),
                               _mm512_set1_epi32(0x7e));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7f800000)),
                               _mm512_set1_epi32(0x7f));
  // code | (u >> 24 & 0x80): the sign bit
  code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80), 0xf8);
  return _mm512_cvtepi32_epi8(code);
}

// The largest |x| bits of one block (NaN ignored), as an FP32 bit pattern.
MOE_EP_FP8_AVX512 inline std::uint32_t block_amax_avx512(const std::uint16_t* in) {
  const __m512i no_sign = _mm512_set1_epi16(0x7fff), inf = _mm512_set1_epi16(0x7f80);
  __m512i amax = _mm512_setzero_si512();
  for (int i = 0; i < kFp8BlockSize; i += 32) {
    const __m512i m = _mm512_and_si512(_mm512_loadu_si512(in + i), no_sign);
    amax = _mm512_mask_max_epu16(amax, _mm512_cmple_epu16_mask(m, inf), amax, m);
  }
  // The 32 halfword maxima folded to 16 words, each the larger of its two halves.
  const __m512i words =
      _mm512_max_epu32(_mm512_and_si512(amax, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(amax, 16));
  return static_cast<std::uint32_t>(_mm512_reduce_max_epu32(words)) << 16;
}

// In chunks of blocks: every block's scale first, then the codes, so that the codes of one block
// do not wait for its scale's reduction and division (a latency chain per block otherwise).
MOE_EP_FP8_AVX512 void cast_bf16_avx512(const std::uint16_t* x, std::int64_t hidden, bool round_scale, bool ue8m0,
                                        std::uint8_t* q, std::byte* scales) {
  constexpr std::int64_t kChunk = 16;
  const std::int64_t blocks = hidden / kFp8BlockSize;
  float factor[kChunk];
  for (std::int64_t first = 0; first < blocks; first += kChunk) {
    const std::int64_t n = std::min(kChunk, blocks - first);
    for (std::int64_t c = 0; c < n; ++c) {
      const Fp8BlockScales s = block_scale(block_amax_avx512(x + (first + c) * kFp8BlockSize), round_scale);
      factor[c] = s.scale;
      store_scale(scales, first + c, s.scale_inv, ue8m0);
    }
    for (std::int64_t c = 0; c < n; ++c) {
      const std::uint16_t* in = x + (first + c) * kFp8BlockSize;
      std::uint8_t* out = q + (first + c) * kFp8BlockSize;
      const __m512 scale = _mm512_set1_ps(factor[c]);
      for (int i = 0; i < kFp8BlockSize; i += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), encode16(in + i, scale));
    }
  }
}
#undef MOE_EP_FP8_AVX512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

}  // namespace

Fp8BlockScales fp8_block_scales(float amax, bool round_scale) {
  const float a = amax >= kFp8AmaxFloor ? amax : kFp8AmaxFloor;  // the floor; NaN gives the floor too
  const float product = a * kFp8E4M3MaxInv;
  // An infinite amax (an infinity in the block) is outside DeepEP's power-of-two helper, whose
  // exponents stay within -126..127: both paths store +inf and multiply the values by 0.
  if (!round_scale || !std::isfinite(product)) return {product, kFp8E4M3Max / a};
  // ceil(log2(product)) from the bits: the exponent field, plus one when any mantissa bit is set
  // (product >= 1e-4 / 448 is normal, so e lies in [-22, 120]).
  const std::uint32_t u = float_bits(product);
  const int e = static_cast<int>((u >> 23) & 0xffu) - 127 + ((u & 0x7fffffu) != 0 ? 1 : 0);
  return {power_of_two(e), power_of_two(-e)};
}

void cast_row_fp8(const std::uint16_t* bf16, std::int64_t hidden, bool round_scale, bool ue8m0, std::uint8_t* q,
                  std::byte* scales) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx512()) return cast_bf16_avx512(bf16, hidden, round_scale, ue8m0, q, scales);
  if (has_avx2()) return cast_bf16_avx2(bf16, hidden, round_scale, ue8m0, q, scales);
#endif
  cast_generic(bf16, hidden, round_scale, ue8m0, q, scales);
}

void cast_row_fp8(const float* fp32, std::int64_t hidden, bool round_scale, bool ue8m0, std::uint8_t* q,
                  std::byte* scales) {
  cast_generic(fp32, hidden, round_scale, ue8m0, q, scales);
}

bool cast_row_fp8_on(Isa isa, const std::uint16_t* bf16, std::int64_t hidden, bool round_scale, bool ue8m0,
                     std::uint8_t* q, std::byte* scales) {
  switch (isa) {
    case Isa::kPortable:
      cast_generic(bf16, hidden, round_scale, ue8m0, q, scales);
      return true;
#ifdef MOE_EP_X86_DISPATCH
    case Isa::kAvx2:
      if (!has_avx2()) return false;
      cast_bf16_avx2(bf16, hidden, round_scale, ue8m0, q, scales);
      return true;
    case Isa::kAvx512:
      if (!has_avx512()) return false;
      cast_bf16_avx512(bf16, hidden, round_scale, ue8m0, q, scales);
      return true;
#endif
    default:
      return false;
  }
}

}  // namespace moe_ep::core
