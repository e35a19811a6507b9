// Tensor-level dtype conversions: BF16 <-> FP32 and FP8 E4M3 per-block quantization.
//
// FP8 quantization works per token row in blocks of 128 consecutive elements (the hidden size
// must be a multiple of 128), with DeepEP's low-latency dispatch formula, one FP32 operation at a
// time (docs/quantized-formats.md, "Scale formulas"). For each block:
//   amax      = max(|x|) over the block, NaN ignored, floored at 1e-4
//   scale_inv = amax * fp32(1/448)               (one FP32 product, not amax / 448; stored)
//   q         = fp8_e4m3(x * (448 / amax))       (FP32 quotient, then product; saturating,
//                                                 round to nearest even)
// With round_scale, e = ceil(log2(amax * fp32(1/448))) (the exponent of the FP32 product, plus
// one when any mantissa bit is set), scale_inv = 2^e and q = fp8_e4m3(x * 2^-e).
// Scales are FP32 [N, H/128], or with use_ue8m0 (requires round_scale) the 8-bit exponent of
// scale_inv packed four per int32, [N, ceil(H/512)]: byte b of int j (little-endian) holds block
// 4j+b; bytes past the last block are 0. Dequantization multiplies q by its block's scale_inv.
//
// NVFP4 quantization (docs/quantized-formats.md) works per row in blocks of 16 elements: one
// scale byte per block (an E4M3 code derived from the global scale gs, or a UE8M0 exponent
// rounded up), two E2M1 codes per byte, element 2i in the low nibble. Dequantization gives
// e2m1(q) * fp32(sf) / gs (E4M3, FP32 product then quotient) or e2m1(q) * 2^(sf - 127) (UE8M0).
#pragma once

#include <optional>

#include "moe_ep/tensor.hpp"

namespace moe_ep {

inline constexpr int kFp8BlockSize = 128;
inline constexpr float kFp8AmaxFloor = 1e-4f;

struct Fp8Options {
  bool round_scale = false;
  bool use_ue8m0 = false;
};

struct Fp8Tensor {
  Tensor data;    // float8_e4m3fn [N, H]
  Tensor scales;  // float32 [N, H/128] or int32 [N, ceil(H/512)] (UE8M0)
};

// The stored scale_inv of one block, given its amax (before the floor).
float fp8_block_scale_inv(float amax, bool round_scale);

// x: bfloat16 or float32 [N, H], rows contiguous, H % 128 == 0.
Fp8Tensor quantize_fp8(const TensorView& x, Fp8Options options = {});
// Returns float32 [N, H]. scales: float32 [N, H/128] or int32 UE8M0 [N, ceil(H/512)], any strides.
Tensor dequantize_fp8(const TensorView& data, const TensorView& scales);

struct Nvfp4Options {
  float global_scale = 1.0f;  // gs: positive and finite; unused with use_ue8m0_for_sf
  bool use_ue8m0_for_sf = false;
  std::optional<E2M1Rounding> rounding;  // unset: MOE_EP_NVFP4_ROUNDING
};

struct Nvfp4Tensor {
  Tensor data;    // uint8 [N, H/2]
  Tensor scales;  // uint8 [N, H/16]: E4M3 codes, or UE8M0 exponents
};

// x: bfloat16 [N, H], rows contiguous, H % 16 == 0.
Nvfp4Tensor quantize_nvfp4(const TensorView& x, const Nvfp4Options& options = {});
// data uint8 [N, H/2], scales uint8 [N, H/16] (rows contiguous); returns float32 [N, H].
Tensor dequantize_nvfp4(const TensorView& data, const TensorView& scales, float global_scale, bool use_ue8m0_for_sf);

// Elementwise conversions into new contiguous tensors.
Tensor to_bf16(const TensorView& x);  // from float32 or bfloat16
Tensor to_fp32(const TensorView& x);  // from bfloat16, float32 or float8_e4m3fn

}  // namespace moe_ep
