// The LogFMT kernels on AVX2: 8 lanes, half a group of 16 codes per vector.
#include "core/cpu_features.hh"
#include "core/logfmt_kernels.hh"
#include "core/logfmt_math.hh"

#ifdef MOE_EP_X86_DISPATCH

#define MOE_EP_LOGFMT_TARGET_NAME "avx2"
#define MOE_EP_LOGFMT_INLINE __attribute__((target(MOE_EP_LOGFMT_TARGET_NAME), always_inline)) inline
#define MOE_EP_LOGFMT_KERNEL __attribute__((target(MOE_EP_LOGFMT_TARGET_NAME)))

namespace moe_ep::core::logfmt {
namespace {

struct Avx2 {
  static constexpr int W = 8;
  // The encoder gathers log2 from the full table (logfmt_simd.hh, Log2Gather): on AVX2 the
  // mantissa table's extra arithmetic cost what the smaller table saved.
  static constexpr bool kLog2ByMantissa = false;
  using F = __m256;
  using I = __m256i;
  using M = __m256i;  // all ones in a selected lane
  MOE_EP_LOGFMT_INLINE static F set(float f) { return _mm256_set1_ps(f); }
  MOE_EP_LOGFMT_INLINE static I set_int(std::int32_t i) { return _mm256_set1_epi32(i); }
  MOE_EP_LOGFMT_INLINE static F add(F a, F b) { return _mm256_add_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F div(F a, F b) { return _mm256_div_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F min(F a, F b) { return _mm256_min_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static F max(F a, F b) { return _mm256_max_ps(a, b); }
  MOE_EP_LOGFMT_INLINE static I add_int(I a, I b) { return _mm256_add_epi32(a, b); }
  MOE_EP_LOGFMT_INLINE static I sub_int(I a, I b) { return _mm256_sub_epi32(a, b); }
  MOE_EP_LOGFMT_INLINE static I and_int(I a, I b) { return _mm256_and_si256(a, b); }
  MOE_EP_LOGFMT_INLINE static I min_int(I a, I b) { return _mm256_min_epi32(a, b); }
  MOE_EP_LOGFMT_INLINE static I or_int(I a, I b) { return _mm256_or_si256(a, b); }
  template <int k>
  MOE_EP_LOGFMT_INLINE static I shl(I a) { return _mm256_slli_epi32(a, k); }
  template <int k>
  MOE_EP_LOGFMT_INLINE static I sra(I a) { return _mm256_srai_epi32(a, k); }
  template <int k>
  MOE_EP_LOGFMT_INLINE static I shr(I a) { return _mm256_srli_epi32(a, k); }
  MOE_EP_LOGFMT_INLINE static I sllv(I a, I n) { return _mm256_sllv_epi32(a, n); }
  MOE_EP_LOGFMT_INLINE static I srlv(I a, I n) { return _mm256_srlv_epi32(a, n); }
  MOE_EP_LOGFMT_INLINE static F as_float(I a) { return _mm256_castsi256_ps(a); }
  MOE_EP_LOGFMT_INLINE static I as_int(F a) { return _mm256_castps_si256(a); }
  MOE_EP_LOGFMT_INLINE static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  MOE_EP_LOGFMT_INLINE static I truncate(F a) { return _mm256_cvttps_epi32(a); }
  MOE_EP_LOGFMT_INLINE static F floor(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  MOE_EP_LOGFMT_INLINE static M lt(F a, F b) { return as_int(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  MOE_EP_LOGFMT_INLINE static M eq(F a, F b) { return as_int(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  MOE_EP_LOGFMT_INLINE static M is_nan(F a) { return as_int(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  MOE_EP_LOGFMT_INLINE static M mask_and(M a, M b) { return _mm256_and_si256(a, b); }
  MOE_EP_LOGFMT_INLINE static unsigned mask_bits(M a) { return static_cast<unsigned>(_mm256_movemask_ps(as_float(a))); }
  MOE_EP_LOGFMT_INLINE static M all_lanes() { return _mm256_set1_epi32(-1); }
  // select(m, a, b): a where m is set, else b.
  MOE_EP_LOGFMT_INLINE static F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, as_float(m)); }
  MOE_EP_LOGFMT_INLINE static I select_int(M m, I a, I b) { return _mm256_blendv_epi8(b, a, m); }
  MOE_EP_LOGFMT_INLINE static F load(const float* p) { return _mm256_loadu_ps(p); }
  MOE_EP_LOGFMT_INLINE static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  MOE_EP_LOGFMT_INLINE static I load_int(const std::int32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  // `count` (at most 8) pairs of BF16 bit patterns as 32-bit lanes, zeros above.
  MOE_EP_LOGFMT_INLINE static I load_pairs(const std::uint16_t* p, int count) {
    const I lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), _mm256_cmpgt_epi32(set_int(count), lane));
  }
  // 8 BF16 bit patterns, zero-extended.
  MOE_EP_LOGFMT_INLINE static I load_u16(const std::uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  MOE_EP_LOGFMT_INLINE static F gather(const float* table, I index) { return _mm256_i32gather_ps(table, index, 4); }
  // n = x rounded to an integer, ties to even (adding and taking away 1.5 * 2^23), and f = x - n.
  MOE_EP_LOGFMT_INLINE static void split(F x, F& n, F& f) {
    const F magic = set(kRoundMagic);
    n = _mm256_sub_ps(_mm256_add_ps(x, magic), magic);
    f = _mm256_sub_ps(x, n);
  }
  // p * 2^n in one rounding (n an integer in [-200, 200]): (p * 2^floor(n/2)) * 2^(n - floor(n/2)),
  // the first product exact; zero where keep is clear.
  MOE_EP_LOGFMT_INLINE static F scale(M keep, F p, F n) {
    const I ni = _mm256_cvtps_epi32(n);
    const I n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1), bias = set_int(127);
    const F s1 = as_float(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const F s2 = as_float(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(p, s1), s2), as_float(keep));
  }
  // d with the sign bit (bit 31) of s set, and w with it flipped.
  MOE_EP_LOGFMT_INLINE static F with_sign(F d, I s) {
    return _mm256_or_ps(d, as_float(_mm256_and_si256(s, set_int(static_cast<std::int32_t>(0x80000000u)))));
  }
  MOE_EP_LOGFMT_INLINE static F xor_sign(F w, I s) {
    return _mm256_xor_ps(w, as_float(_mm256_and_si256(s, set_int(static_cast<std::int32_t>(0x80000000u)))));
  }
  // BF16 rounding to nearest even; NaN keeps its sign and top payload bits, quieted.
  MOE_EP_LOGFMT_INLINE static void store_bf16(std::uint16_t* p, F v) {
    const I u = as_int(v);
    const I lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), set_int(1));
    const I rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, set_int(0x7fff)), lsb), 16);
    const I nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), set_int(0x40));
    const I is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, set_int(0x7fffffff)), set_int(0x7f800000));
    const I bits = _mm256_blendv_epi8(rounded, nan, is_nan);  // each lane <= 0xffff
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  // The five words of a group in lanes 0..4, zeros above.
  MOE_EP_LOGFMT_INLINE static I load_words(const std::byte* p) {
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), _mm256_setr_epi32(-1, -1, -1, -1, -1, 0, 0, 0));
  }
  MOE_EP_LOGFMT_INLINE static I permute(I table, I index) { return _mm256_permutevar8x32_epi32(table, index); }
  // Codes 2j and 2j + 1 as code 2j | code 2j+1 << 9 in 64-bit word j.
  MOE_EP_LOGFMT_INLINE static void store_pairs(I code, std::uint64_t* out) {
    const I pair = _mm256_or_si256(_mm256_and_si256(code, _mm256_set1_epi64x(0x1ff)), _mm256_srli_epi64(code, 23));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), pair);
  }
  MOE_EP_LOGFMT_INLINE static std::uint32_t sign_bits(I v) { return static_cast<std::uint32_t>(_mm256_movemask_ps(as_float(v))); }
  MOE_EP_LOGFMT_INLINE static std::uint16_t smallest(__m128i v) {
    return static_cast<std::uint16_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(v)));
  }
  // The largest and smallest magnitude bits of 128 BF16 values, folded into amax and amin.
  MOE_EP_LOGFMT_INLINE static void magnitude_range(const std::uint16_t* x, std::uint16_t& amax, std::uint16_t& amin) {
    const I mask = _mm256_set1_epi16(0x7fff);
    I hi = _mm256_setzero_si256(), lo = _mm256_set1_epi16(static_cast<std::int16_t>(amin));
    for (int i = 0; i < kBlock; i += 16) {
      const I m = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mask);
      hi = _mm256_max_epu16(hi, m);
      lo = _mm256_min_epu16(lo, m);
    }
    const __m128i hi4 = _mm_max_epu16(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    const __m128i lo4 = _mm_min_epu16(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
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
const Kernels kAvx2Kernels = kernels_of<Avx2>();
}  // namespace moe_ep::core::logfmt

#endif
