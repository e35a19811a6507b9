// LogFMT-10 row codec of the low-latency combine (docs/quantized-formats.md).
//
// A row of H BF16 values (H a multiple of 128) is encoded as:
//   [meta: one (amax, amin) BF16 pair per 128-channel block, 4 B each]
//   [chunks of 256 * U elements (U = 4 when H % 1024 == 0, else 2; the last chunk may be
//    shorter), each either LogFMT (10 bits per element: 9-bit codes, then 16 sign bits per 16
//    elements, 20 B per 16) when every block of the chunk is castable, or the BF16 values]
// A block is castable iff la = log2(amax) < 0 and ln = max(log2(amin), la - 32) < la (amin = 0
// gives la - 32). Codes, in DeepEP's order of operations: step = (la - ln) / 510, step_inv = 1 /
// step, r = 2 - log2((1 + exp2(step)) * 0.5) * step_inv, fused = r - ln * step_inv; code =
// floor(max(log2(v) * step_inv + fused, 0)), at most 511; v = 0 gives 0. Decoding gives 0 for
// code 0, else exp2((code - 1) * step + ln), with the sign. Every step is one IEEE FP32 operation
// (no fused multiply-add) and log2 and exp2 are the codec's own (logfmt_math.hh: fixed FP32
// polynomials), so the bits are the same on every machine and instruction set; a GPU's approximate
// lg2/ex2 and its fused multiply-adds may put a value one code away at a level boundary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace moe_ep::core {

// Largest encoded size of a row: the meta plus the BF16 size (2H + 4 * H / 128).
std::int64_t logfmt_max_row_bytes(std::int64_t hidden);
// Encodes `hidden` BF16 values into `out` (room for logfmt_max_row_bytes); returns the bytes used.
std::int64_t logfmt_encode_row(const std::uint16_t* bf16, std::int64_t hidden, std::byte* out);
// Decodes an encoded row into `hidden` FP32 values; returns the bytes read.
std::int64_t logfmt_decode_row(const std::byte* in, std::int64_t hidden, float* out);

// A row of a LogFMT combine: its encoding (`encoded`, a row that traveled encoded) or its BF16
// values (`bf16`, a row read in place), of which what its encoding decodes to is used.
struct LogfmtRow {
  const std::byte* encoded = nullptr;
  const std::uint16_t* bf16 = nullptr;
};
// out[h] = bf16_rne(w[0]*v0[h] + w[1]*v1[h] + ...), v_r what row r decodes to: FP32 products, summed
// in row order, no fused multiply-add, one BF16 rounding; no rows give +0. The same bits as
// decoding every row (encoding the BF16 ones first) and summing with weighted_sum_fp32_rows.
void logfmt_weighted_sum(std::span<const LogfmtRow> rows, std::span<const float> weights, std::uint16_t* out,
                         std::int64_t hidden);

// The instruction set of the codec's kernels; kAuto (the default) picks the widest this CPU has.
// All give the same bits: tests select each in turn. Returns false, changing nothing, for one this
// CPU (or this build) does not have.
enum class LogfmtIsa { kAuto, kScalar, kAvx2, kAvx512 };
bool logfmt_select_isa(LogfmtIsa isa);

}  // namespace moe_ep::core
