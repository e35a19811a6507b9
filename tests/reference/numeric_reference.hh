// Element-type references written from the format definitions (docs/semantics.md §1), sharing no
// code with src/: BF16 <-> FP32, FP8 E4M3 ("fn") encoding, and the per-128 block quantization of
// a token row. The test expectations that involve rounding are computed with these, so that a
// change in the library's conversions cannot move the expectation along with the result.
#pragma once

#include <cstdint>
#include <vector>

namespace moe_ep::reference {

// The bits of a float and back (no library helper).
std::uint32_t bits_of(float f);
float float_of(std::uint32_t bits);

// FP32 -> BF16: round to nearest, ties to even, on the 16 dropped bits; NaN stays NaN with the
// quiet bit (0x0040) set and the sign kept; values past the largest BF16 round to infinity.
std::uint16_t bf16_from_float(float f);
// BF16 -> FP32: exact.
float float_from_bf16(std::uint16_t b);

// FP32 -> FP8 E4M3fn: the value is placed on the E4M3 grid of its binade (step 2^(e-3) for
// normal binade e >= -6, 2^-9 below), rounded to nearest with ties to even, then saturated: any
// finite or infinite magnitude above 448 becomes 448 (code 0x7e); NaN becomes 0x7f (sign kept).
std::uint8_t fp8_e4m3_from_float(float f);
// FP8 E4M3fn -> value (NaN for 0x7f / 0xff).
double fp8_e4m3_value(std::uint8_t code);

// FP4 E2M1 by search: the code (sign bit 3, magnitude index 0..7 of {0, .5, 1, 1.5, 2, 3, 4, 6}) of
// the nearest magnitude, compared in double; of two equally near, the one with the even index;
// beyond 6 (and infinity) 6; NaN gives index 7 with the NaN's sign. `sm90`: the comparisons of
// DeepEP's pre-SM100 fallback instead (|v| < 0.5 -> 0, < 1 -> 0.5, < 2 -> 1.5 above sqrt 2 else 1,
// < 4 -> 3 above 2 sqrt 2 else 2, else 6 above 4 sqrt 2 else 4; the roots as the nearest floats).
std::uint8_t e2m1_from_float(float f, bool sm90);
double e2m1_value(std::uint8_t code);
// UE8M0 by search: the least b in 0..254 with 2^(b-127) >= f (254 when none; f >= 0), 255 for NaN
// or negative f.
std::uint8_t ue8m0_ceil_from_float(float f);

// One BF16 token row cast to NVFP4 (docs/quantized-formats.md), written from the definition with
// the search conversions above: per 16-element block vmax = max |x| (NaN ignored); E4M3 scales
// sf = e4m3(gs * (vmax * fp32(1/6))) and out_scale = sf ? 1 / (value(sf) * (1 / gs)) : 0, or UE8M0
// sf = ue8m0_ceil(vmax * fp32(1/6)) and out_scale = sf ? 2^(127 - sf) : 1 (FP32 operations in that
// order); codes e2m1(x * out_scale), element 2i in the low nibble.
struct Nvfp4Row {
  std::vector<std::uint8_t> packed;  // [hidden / 2]
  std::vector<std::uint8_t> scales;  // [hidden / 16]
};
Nvfp4Row quantize_row_nvfp4(const std::uint16_t* bf16, int hidden, float global_scale, bool ue8m0, bool sm90);

// One token row cast to FP8 with per-128-element block scales, DeepEP's low-latency formula:
//   amax = max |x| over the block (NaN ignored), floored at 1e-4;
//   scale_inv = amax * fp32(1/448), one FP32 product (not the quotient amax / 448); with
//   round_scale 2^ceil(log2(scale_inv)) (an infinite product stays infinite);
//   code = e4m3(x * (448 / amax)), or e4m3(x * 2^-ceil(log2(amax * fp32(1/448)))) with round_scale
//   (FP32 products; an infinite amax multiplies by 0);
//   scales: one FP32 word per block, or with ue8m0 the exponent byte of scale_inv packed four per
//   32-bit word (byte b of word j = block 4j + b, little-endian; unused bytes 0).
struct Fp8Row {
  std::vector<std::uint8_t> codes;    // [hidden]
  std::vector<std::uint32_t> scales;  // [hidden / 128] FP32 bits, or [ceil(hidden / 512)] packed words
};
Fp8Row quantize_row_fp8(const std::uint16_t* bf16, int hidden, bool round_scale, bool ue8m0);
Fp8Row quantize_row_fp8(const float* values, int hidden, bool round_scale, bool ue8m0);

}  // namespace moe_ep::reference
