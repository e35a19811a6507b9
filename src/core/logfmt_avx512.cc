// The LogFMT kernels on AVX-512 (F, BW and DQ): 16 lanes, one group of 16 codes per vector.
#include "core/cpu_features.hh"
#include "core/logfmt_kernels.hh"
#include "core/logfmt_math.hh"

#ifdef MOE_EP_X86_DISPATCH

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() values, which -Wuninitialized
// reports where they are inlined (GCC bug 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define MOE_EP_LOGFMT_TARGET_NAME "avx512f,avx512bw,avx512dq"
#define MOE_EP_LOGFMT_INLINE __attribute__((target(MOE_EP_LOGFMT_TARGET_NAME), always_inline)) inline
#define MOE_EP_LOGFMT_KERNEL __attribute__((target(MOE_EP_LOGFMT_TARGET_NAME)))

namespace moe_ep::core::logfmt {
namespace {

struct Avx512 {
  static constexpr int W = 16;
  // The encoder looks log2 up by mantissa (logfmt_simd.hh, Log2Tables): eight registers, no loads.
  static constexpr bool kLog2ByMantissa = true;
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  MOE_EP_LOGFMT_INLINE static F set(float f) { return _mm512_set1_ps(f); }
  MOE_EP_LOGFMT_INLINE static I set_int(std::int32_t i) { return _mm512_set1_epi32(i); }
  MOE_EP_LOGFMT_INLINE static F add(F a, F b) { return _mm512_add_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F div(F a, F b) { return _mm512_div_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F min(F a, F b) { return _mm512_min_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F max(F a, F b) { return _mm512_max_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static I add_int(I a, I b) { return _mm512_add_epi32(a, b); }
  MOE_EP_LOGFMT_INLINE static I sub_int(I a, I b) { return _mm512_sub_epi32(a, b); }
  MOE_EP_LOGFMT_INLINE static I and_int(I a, I b) { return _mm512_and_si512(a, b); }
  MOE_EP_LOGFMT_INLINE static I min_int(I a, I b) { return _mm512_min_epi32(a, b); }
  MOE_EP_LOGFMT_INLINE static I or_int(I a, I b) { return _mm512_or_si512(a, b); }
  template <int k>
  MOE_EP_LOGFMT_INLINE static I shl(I a) { return _mm512_slli_epi32(a, k); }
  template <int k>
  MOE_EP_LOGFMT_INLINE static I sra(I a) { return _mm512_srai_epi32(a, k); }
  template <int k>
  MOE_EP_LOGFMT_INLINE static I shr(I a) { return _mm512_srli_epi32(a, k); }
  MOE_EP_LOGFMT_INLINE static I sllv(I a, I n) { return _mm512_sllv_epi32(a, n); }
  MOE_EP_LOGFMT_INLINE static I srlv(I a, I n) { return _mm512_srlv_epi32(a, n); }
  MOE_EP_LOGFMT_INLINE static F as_float(I a) { return _mm512_castsi512_ps(a); }
  MOE_EP_LOGFMT_INLINE static I as_int(F a) { return _mm512_castps_si512(a); }
  MOE_EP_LOGFMT_INLINE static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  MOE_EP_LOGFMT_INLINE static I truncate(F a) { return _mm512_cvttps_epi32(a); }
  MOE_EP_LOGFMT_INLINE static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  MOE_EP_LOGFMT_INLINE static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  MOE_EP_LOGFMT_INLINE static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  MOE_EP_LOGFMT_INLINE static M is_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  MOE_EP_LOGFMT_INLINE static M lt_int(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  MOE_EP_LOGFMT_INLINE static M mask_and(M a, M b) { return static_cast<M>(a & b); }
  MOE_EP_LOGFMT_INLINE static M mask_or(M a, M b) { return static_cast<M>(a | b); }
  MOE_EP_LOGFMT_INLINE static unsigned mask_bits(M a) { return a; }
  MOE_EP_LOGFMT_INLINE static M all_lanes() { return 0xffff; }
  // select(m, a, b): a where m is set, else b.
  MOE_EP_LOGFMT_INLINE static F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  MOE_EP_LOGFMT_INLINE static I select_int(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }
  MOE_EP_LOGFMT_INLINE static F load(const float* p) { return _mm512_loadu_ps(p); }
  MOE_EP_LOGFMT_INLINE static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  MOE_EP_LOGFMT_INLINE static I load_int(const std::int32_t* p) { return _mm512_loadu_si512(p); }
  // `count` (at most 16) pairs of BF16 bit patterns as 32-bit lanes, zeros above.
  MOE_EP_LOGFMT_INLINE static I load_pairs(const std::uint16_t* p, int count) {
    return _mm512_maskz_loadu_epi32(static_cast<M>((1u << count) - 1u), p);
  }
  // 16 BF16 bit patterns, zero-extended.
  MOE_EP_LOGFMT_INLINE static I load_u16(const std::uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  MOE_EP_LOGFMT_INLINE static F gather(const float* table, I index) { return _mm512_i32gather_ps(index, table, 4); }
  // A table of 128 floats held in eight registers; lookup(i) = table[i] for lanes i in [0, 128):
  // four two-register permutes (index bits 0 to 4) and blends by bits 5 and 6.
  struct Mantissas {
    F t[8];
    MOE_EP_LOGFMT_INLINE explicit Mantissas(const float* table) {
      for (int i = 0; i < 8; ++i) t[i] = _mm512_loadu_ps(table + 16 * i);
    }
    MOE_EP_LOGFMT_INLINE F lookup(I index) const {
      const F a = _mm512_permutex2var_ps(t[0], index, t[1]), b = _mm512_permutex2var_ps(t[2], index, t[3]);
      const F c = _mm512_permutex2var_ps(t[4], index, t[5]), d = _mm512_permutex2var_ps(t[6], index, t[7]);
      const M bit5 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
      const M bit6 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(64));
      return _mm512_mask_blend_ps(bit6, _mm512_mask_blend_ps(bit5, a, b), _mm512_mask_blend_ps(bit5, c, d));
    }
  };
  // n = x rounded to an integer, ties to even, and f = x - n (both exact): vreduceps gives f.
  MOE_EP_LOGFMT_INLINE static void split(F x, F& n, F& f) {
    f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n = _mm512_sub_ps(x, f);
  }
  // p * 2^n in one rounding (n an integer in [-200, 200]), zero where keep is clear.
  MOE_EP_LOGFMT_INLINE static F scale(M keep, F p, F n) { return _mm512_maskz_scalef_ps(keep, p, n); }
  // d with the sign bit (bit 31) of s set, and w with it flipped.
  MOE_EP_LOGFMT_INLINE static F with_sign(F d, I s) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(d), s, set_int(static_cast<std::int32_t>(0x80000000u)), 0xf8));
  }
  MOE_EP_LOGFMT_INLINE static F xor_sign(F w, I s) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(s, _mm512_castps_si512(w), set_int(static_cast<std::int32_t>(0x80000000u)), 0x6c));
  }
  // BF16 rounding to nearest even; NaN keeps its sign and top payload bits, quieted.
  MOE_EP_LOGFMT_INLINE static void store_bf16(std::uint16_t* p, F v) {
    const I u = _mm512_castps_si512(v);
    const I lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), set_int(1));
    const I rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, set_int(0x7fff)), lsb), 16);
    const I nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), set_int(0x40));
    const M is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, set_int(0x7fffffff)), set_int(0x7f800000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan)));
  }
  // The five words of a group in lanes 0..4, zeros above.
  MOE_EP_LOGFMT_INLINE static I load_words(const std::byte* p) { return _mm512_maskz_loadu_epi32(0x1f, p); }
  MOE_EP_LOGFMT_INLINE static I permute(I table, I index) { return _mm512_permutexvar_epi32(index, table); }
  // Codes 2j and 2j + 1 as code 2j | code 2j+1 << 9 in 64-bit word j.
  MOE_EP_LOGFMT_INLINE static void store_pairs(I code, std::uint64_t* out) {
    const I pair = _mm512_or_si512(_mm512_and_si512(code, _mm512_set1_epi64(0x1ff)), _mm512_srli_epi64(code, 23));
    _mm512_storeu_si512(out, pair);
  }
  MOE_EP_LOGFMT_INLINE static std::uint32_t sign_bits(I v) { return _mm512_cmplt_epi32_mask(v, _mm512_setzero_si512()); }
  MOE_EP_LOGFMT_INLINE static std::uint16_t smallest(__m128i v) {
    return static_cast<std::uint16_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(v)));
  }
  // The largest and smallest magnitude bits of 128 BF16 values, folded into amax and amin.
  MOE_EP_LOGFMT_INLINE static void magnitude_range(const std::uint16_t* x, std::uint16_t& amax, std::uint16_t& amin) {
    const I mask = _mm512_set1_epi16(0x7fff);
    I hi = _mm512_setzero_si512(), lo = _mm512_set1_epi16(static_cast<std::int16_t>(amin));
    for (int i = 0; i < kBlock; i += 32) {
      const I m = _mm512_and_si512(_mm512_loadu_si512(x + i), mask);
      hi = _mm512_max_epu16(hi, m);
      lo = _mm512_min_epu16(lo, m);
    }
    __m256i hi8 = _mm256_max_epu16(_mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1));
    __m256i lo8 = _mm256_min_epu16(_mm512_castsi512_si256(lo), _mm512_extracti64x4_epi64(lo, 1));
    const __m128i hi4 = _mm_max_epu16(_mm256_castsi256_si128(hi8), _mm256_extracti128_si256(hi8, 1));
    const __m128i lo4 = _mm_min_epu16(_mm256_castsi256_si128(lo8), _mm256_extracti128_si256(lo8, 1));
    // minpos finds the smallest of eight: the largest is the smallest of the complements.
    const std::uint16_t top = static_cast<std::uint16_t>(0xffff - smallest(_mm_xor_si128(hi4, _mm_set1_epi16(-1))));
    const std::uint16_t bottom = smallest(lo4);
    amax = top > amax ? top : amax;
    amin = bottom < amin ? bottom : amin;
  }
};

}  // namespace
}  // namespace moe_ep::core::logfmt

#include "core/logfmt_simd.hh"

namespace moe_ep::core::logfmt {
const Kernels kAvx512Kernels = kernels_of<Avx512>();
}  // namespace moe_ep::core::logfmt

#endif
