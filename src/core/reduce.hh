// Row kernels shared by every buffer: BF16 reductions with FP32 accumulation, and row copies.
//
// sum_bf16_rows computes, for every element h,
//   out[h] = bf16_rne( ((in[0][h] + in[1][h]) + in[2][h]) + ... + in[n-1][h] )
// in IEEE single precision, strictly in input order, rounding once at the end; one input is
// passed through unchanged (bf16 -> fp32 -> bf16 is exact) and no input gives +0. Callers put
// biases first, then contributions, to get the documented reduction order. The result does not
// depend on the instruction set used (the vector paths perform the same sequence of FP32 adds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace moe_ep::core {

void sum_bf16_rows(std::span<const std::uint16_t* const> inputs, std::uint16_t* out, std::int64_t hidden);
// The same result written with non-temporal stores where possible (see copy_bytes_streaming;
// streaming_fence() before the row is published).
void sum_bf16_rows_streaming(std::span<const std::uint16_t* const> inputs, std::uint16_t* out, std::int64_t hidden);
// A term of a two-level sum: `rows` summed in FP32 in order and rounded to BF16 once (one row: the
// row as it is). sum_bf16_terms_streaming computes
//   out[h] = bf16_rne( (term[0][h] + term[1][h]) + ... )
// over the terms' BF16 values, the same bits as writing each term of several rows with
// sum_bf16_rows into a row of its own and summing those rows, without the intermediate rows.
struct Bf16Term {
  std::span<const std::uint16_t* const> rows;  // not empty
};
void sum_bf16_terms_streaming(std::span<const Bf16Term> terms, std::uint16_t* out, std::int64_t hidden);
// out[h] = bf16_rne(w[0]*in[0][h] + w[1]*in[1][h] + ...): FP32 products, summed in input order,
// no fused multiply-add; no input gives +0.
void weighted_sum_bf16_rows(std::span<const std::uint16_t* const> inputs, std::span<const float> weights,
                            std::uint16_t* out, std::int64_t hidden);
// The same sum over FP32 rows (decoded LogFMT rows): out[h] = bf16_rne(w[0]*in[0][h] + ...).
void weighted_sum_fp32_rows(std::span<const float* const> inputs, std::span<const float> weights, std::uint16_t* out,
                            std::int64_t hidden);
// memcpy with non-temporal stores where the CPU has them (AVX2, dst 32-byte aligned, 256 bytes or
// more; a plain memcpy otherwise): the destination lines are written without being read into the cache first, so a
// copy into an output much larger than the cache moves two bytes of memory traffic per byte
// instead of three. The stores are weakly ordered: call streaming_fence() on the copying thread
// before anything that publishes the bytes to another thread (a release store, a barrier).
void copy_bytes_streaming(void* dst, const void* src, std::size_t bytes);
// Column-major placement of row records: the 4-byte value c of record r (at records[r] + 4 * c)
// goes to dst[c * column_stride + r], for every r < records.size() and c < columns. When dst is
// 64-byte aligned and column_stride and capacity (the elements a column holds) are multiples of
// 16, each column is written in whole 64-byte lines with non-temporal stores (AVX2), the last
// line of a column padded with zeros: no line is read before it is written, as a lone 4-byte
// store into a line not in the cache would. Otherwise, and without AVX2, plain stores of the
// values alone. streaming_fence() as for copy_bytes_streaming.
void place_columns_streaming(std::span<const std::byte* const> records, int columns, std::uint32_t* dst,
                             std::int64_t column_stride, std::int64_t capacity);
void streaming_fence();

}  // namespace moe_ep::core
