#include "core/reduce.hh"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/cpu_features.hh"
#include "moe_ep/dtype.hpp"

// Vector paths: the same scalar code compiled for AVX2 and selected at run time. Every path does
// the same FP32 operations in the same order; -ffp-contract is off for this file (no FMA fusion).

namespace moe_ep::core {
namespace {

constexpr std::int64_t kChunk = 512;

inline __attribute__((always_inline)) float widen(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

inline __attribute__((always_inline)) std::uint16_t narrow(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline __attribute__((always_inline)) void sum_impl(std::span<const std::uint16_t* const> inputs, std::uint16_t* out,
                                                   std::int64_t hidden) {
  float acc[kChunk];
  for (std::int64_t h0 = 0; h0 < hidden; h0 += kChunk) {
    const std::int64_t n = hidden - h0 < kChunk ? hidden - h0 : kChunk;
    if (inputs.empty()) {
      for (std::int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
    } else {
      const std::uint16_t* first = inputs[0] + h0;
      for (std::int64_t i = 0; i < n; ++i) acc[i] = widen(first[i]);
    }
    for (std::size_t r = 1; r < inputs.size(); ++r) {
      const std::uint16_t* p = inputs[r] + h0;
      for (std::int64_t i = 0; i < n; ++i) acc[i] += widen(p[i]);
    }
    for (std::int64_t i = 0; i < n; ++i) out[h0 + i] = narrow(acc[i]);
  }
}

inline __attribute__((always_inline)) void weighted_impl(std::span<const std::uint16_t* const> inputs,
                                                        std::span<const float> weights, std::uint16_t* out,
                                                        std::int64_t hidden) {
  float acc[kChunk];
  for (std::int64_t h0 = 0; h0 < hidden; h0 += kChunk) {
    const std::int64_t n = hidden - h0 < kChunk ? hidden - h0 : kChunk;
    for (std::int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
    for (std::size_t r = 0; r < inputs.size(); ++r) {
      const std::uint16_t* p = inputs[r] + h0;
      const float w = weights[r];
      if (r == 0) {
        for (std::int64_t i = 0; i < n; ++i) acc[i] = w * widen(p[i]);
      } else {
        for (std::int64_t i = 0; i < n; ++i) {
          const float product = w * widen(p[i]);
          acc[i] += product;
        }
      }
    }
    for (std::int64_t i = 0; i < n; ++i) out[h0 + i] = narrow(acc[i]);
  }
}

// One term's value at element h: its row, or the BF16 rounding of its rows' FP32 sum.
inline __attribute__((always_inline)) float term_value(const Bf16Term& term, std::int64_t h) {
  float acc = widen(term.rows[0][h]);
  if (term.rows.size() == 1) return acc;
  for (std::size_t r = 1; r < term.rows.size(); ++r) acc += widen(term.rows[r][h]);
  return widen(narrow(acc));
}

void terms_generic(std::span<const Bf16Term> terms, std::uint16_t* out, std::int64_t hidden, std::int64_t from = 0) {
  for (std::int64_t h = from; h < hidden; ++h) {
    float acc = term_value(terms[0], h);
    for (std::size_t t = 1; t < terms.size(); ++t) acc += term_value(terms[t], h);
    out[h] = narrow(acc);
  }
}

void sum_generic(std::span<const std::uint16_t* const> inputs, std::uint16_t* out, std::int64_t hidden) {
  sum_impl(inputs, out, hidden);
}
void weighted_generic(std::span<const std::uint16_t* const> inputs, std::span<const float> weights,
                      std::uint16_t* out, std::int64_t hidden) {
  weighted_impl(inputs, weights, out, hidden);
}

#ifdef MOE_EP_X86_DISPATCH
// AVX2: 32 elements per step with the accumulators in registers; each element sees the same FP32
// additions in the same order as the scalar code.
__attribute__((target("avx2"))) inline __m256 widen8(const std::uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

__attribute__((target("avx2"))) inline __m256i narrow8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}

// kStream: a non-temporal store (out 32-byte aligned).
template <bool kStream>
__attribute__((target("avx2"))) inline void store16(std::uint16_t* out, __m256 a, __m256 b) {
  // packus interleaves 128-bit lanes; the permute restores element order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(narrow8(a), narrow8(b)), 0xD8);
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out), packed);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  }
}

template <bool kStream>
__attribute__((target("avx2"))) void sum_avx2(std::span<const std::uint16_t* const> inputs, std::uint16_t* out,
                                              std::int64_t hidden) {
  const std::size_t n = inputs.size();
  if (n == 0) {
    std::memset(out, 0, static_cast<std::size_t>(hidden) * sizeof(std::uint16_t));
    return;
  }
  std::int64_t h = 0;
  for (; h + 32 <= hidden; h += 32) {
    __m256 a0 = widen8(inputs[0] + h), a1 = widen8(inputs[0] + h + 8), a2 = widen8(inputs[0] + h + 16),
           a3 = widen8(inputs[0] + h + 24);
    for (std::size_t r = 1; r < n; ++r) {
      const std::uint16_t* p = inputs[r] + h;
      a0 = _mm256_add_ps(a0, widen8(p));
      a1 = _mm256_add_ps(a1, widen8(p + 8));
      a2 = _mm256_add_ps(a2, widen8(p + 16));
      a3 = _mm256_add_ps(a3, widen8(p + 24));
    }
    store16<kStream>(out + h, a0, a1);
    store16<kStream>(out + h + 16, a2, a3);
  }
  if (h < hidden) {  // tail: the scalar code on the remaining elements
    std::uint16_t* rest = out + h;
    const std::int64_t count = hidden - h;
    for (std::int64_t i = 0; i < count; ++i) {
      float acc = widen(inputs[0][h + i]);
      for (std::size_t r = 1; r < n; ++r) acc += widen(inputs[r][h + i]);
      rest[i] = narrow(acc);
    }
  }
}
// The BF16 rounding of v, as an FP32 value (narrow8 then widen).
__attribute__((target("avx2"))) inline __m256 round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), high);
  const __m256i nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), high);
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, nan, is_nan));
}

// 32 elements of one term at h, in four registers.
__attribute__((target("avx2"))) inline void term32(const Bf16Term& term, std::int64_t h, __m256 v[4]) {
  const std::uint16_t* p = term.rows[0] + h;
  v[0] = widen8(p), v[1] = widen8(p + 8), v[2] = widen8(p + 16), v[3] = widen8(p + 24);
  if (term.rows.size() == 1) return;
  for (std::size_t r = 1; r < term.rows.size(); ++r) {
    const std::uint16_t* q = term.rows[r] + h;
    v[0] = _mm256_add_ps(v[0], widen8(q));
    v[1] = _mm256_add_ps(v[1], widen8(q + 8));
    v[2] = _mm256_add_ps(v[2], widen8(q + 16));
    v[3] = _mm256_add_ps(v[3], widen8(q + 24));
  }
  for (int i = 0; i < 4; ++i) v[i] = round8(v[i]);
}

template <bool kStream>
__attribute__((target("avx2"))) void terms_avx2(std::span<const Bf16Term> terms, std::uint16_t* out, std::int64_t hidden) {
  std::int64_t h = 0;
  for (; h + 32 <= hidden; h += 32) {
    __m256 acc[4], v[4];
    term32(terms[0], h, acc);
    for (std::size_t t = 1; t < terms.size(); ++t) {
      term32(terms[t], h, v);
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_add_ps(acc[i], v[i]);
    }
    store16<kStream>(out + h, acc[0], acc[1]);
    store16<kStream>(out + h + 16, acc[2], acc[3]);
  }
  if (h < hidden) terms_generic(terms, out, hidden, h);
}

__attribute__((target("avx2"))) void weighted_avx2(std::span<const std::uint16_t* const> inputs,
                                                   std::span<const float> weights, std::uint16_t* out,
                                                   std::int64_t hidden) {
  weighted_impl(inputs, weights, out, hidden);
}
#endif

}  // namespace

void sum_bf16_rows(std::span<const std::uint16_t* const> inputs, std::uint16_t* out, std::int64_t hidden) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2()) return sum_avx2<false>(inputs, out, hidden);
#endif
  sum_generic(inputs, out, hidden);
}

void sum_bf16_rows_streaming(std::span<const std::uint16_t* const> inputs, std::uint16_t* out, std::int64_t hidden) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2() && (reinterpret_cast<std::uintptr_t>(out) & 31u) == 0) return sum_avx2<true>(inputs, out, hidden);
#endif
  sum_bf16_rows(inputs, out, hidden);
}

void sum_bf16_terms_streaming(std::span<const Bf16Term> terms, std::uint16_t* out, std::int64_t hidden) {
  if (terms.empty()) {
    std::memset(out, 0, static_cast<std::size_t>(hidden) * sizeof(std::uint16_t));
    return;
  }
  // Terms of one row each (the compact layout's): a term's rounding leaves its BF16 row as it is,
  // so the result is the plain sum of the rows in order, whose kernel reads one pointer per row
  // instead of a term's span of them (0.84x the time on 6 rows: kernels_bench BM_CombineRowKernels).
  constexpr std::size_t kMaxRows = 64;
  if (terms.size() <= kMaxRows &&
      std::all_of(terms.begin(), terms.end(), [](const Bf16Term& t) { return t.rows.size() == 1; })) {
    const std::uint16_t* rows[kMaxRows];
    for (std::size_t t = 0; t < terms.size(); ++t) rows[t] = terms[t].rows[0];
    return sum_bf16_rows_streaming({rows, terms.size()}, out, hidden);
  }
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2()) {
    if ((reinterpret_cast<std::uintptr_t>(out) & 31u) == 0) return terms_avx2<true>(terms, out, hidden);
    return terms_avx2<false>(terms, out, hidden);
  }
#endif
  terms_generic(terms, out, hidden);
}

void weighted_sum_bf16_rows(std::span<const std::uint16_t* const> inputs, std::span<const float> weights,
                            std::uint16_t* out, std::int64_t hidden) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2()) return weighted_avx2(inputs, weights, out, hidden);
#endif
  weighted_generic(inputs, weights, out, hidden);
}

void weighted_sum_fp32_rows(std::span<const float* const> inputs, std::span<const float> weights, std::uint16_t* out,
                            std::int64_t hidden) {
  for (std::int64_t h = 0; h < hidden; ++h) {
    float acc = 0.0f;
    for (std::size_t r = 0; r < inputs.size(); ++r) {
      const float product = weights[r] * inputs[r][h];
      acc = r == 0 ? product : acc + product;
    }
    out[h] = float_to_bf16(acc);
  }
}

#ifdef MOE_EP_X86_DISPATCH
namespace {
// 128 bytes per step: unaligned loads, aligned streaming stores (dst is 32-byte aligned).
__attribute__((target("avx2"))) void stream_avx2(std::byte* dst, const std::byte* src, std::size_t bytes) {
  std::size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  for (; i + 32 <= bytes; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  if (i < bytes) std::memcpy(dst + i, src + i, bytes - i);
}
}  // namespace
#endif

void copy_bytes_streaming(void* dst, const void* src, std::size_t bytes) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2() && (reinterpret_cast<std::uintptr_t>(dst) & 31u) == 0 && bytes >= 256)
    return stream_avx2(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes);
#endif
  std::memcpy(dst, src, bytes);
}

namespace {
std::uint32_t record_value(std::span<const std::byte* const> records, std::int64_t r, int c) {
  std::uint32_t v = 0;
  if (r < static_cast<std::int64_t>(records.size())) std::memcpy(&v, records[static_cast<std::size_t>(r)] + 4 * c, 4);
  return v;
}

#ifdef MOE_EP_X86_DISPATCH
// Blocks of 64 records (their values stay in the first-level cache across the columns), one
// 64-byte line of a column at a time.
__attribute__((target("avx2"))) void place_columns_avx2(std::span<const std::byte* const> records, int columns,
                                                        std::uint32_t* dst, std::int64_t column_stride) {
  const auto n = static_cast<std::int64_t>(records.size());
  for (std::int64_t r0 = 0; r0 < n; r0 += 64) {
    const std::int64_t end = std::min(n, r0 + 64);
    for (int c = 0; c < columns; ++c) {
      std::uint32_t* column = dst + c * column_stride;
      for (std::int64_t line = r0; line < end; line += 16) {
        alignas(32) std::uint32_t v[16];
        for (int j = 0; j < 16; ++j) v[j] = record_value(records, line + j, c);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(column + line), _mm256_load_si256(reinterpret_cast<const __m256i*>(v)));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(column + line + 8),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(v + 8)));
      }
    }
  }
}
#endif
}  // namespace

void place_columns_streaming(std::span<const std::byte* const> records, int columns, std::uint32_t* dst,
                             std::int64_t column_stride, std::int64_t capacity) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2() && (reinterpret_cast<std::uintptr_t>(dst) & 63u) == 0 && column_stride % 16 == 0 && capacity % 16 == 0)
    return place_columns_avx2(records, columns, dst, column_stride);
#endif
  (void)capacity;
  for (int c = 0; c < columns; ++c)
    for (std::size_t r = 0; r < records.size(); ++r)
      dst[c * column_stride + static_cast<std::int64_t>(r)] = record_value(records, static_cast<std::int64_t>(r), c);
}

void streaming_fence() {
#ifdef MOE_EP_X86_DISPATCH
  _mm_sfence();
#endif
}

}  // namespace moe_ep::core
