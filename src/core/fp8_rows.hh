// Per-row FP8 E4M3 cast with per-128-element block scales: the rule of moe_ep/convert.hpp, which
// is DeepEP's low-latency dispatch cast operation for operation (docs/quantized-formats.md):
// amax = max(|x|) over the block, NaN ignored, floored at 1e-4; scale_inv = amax * fp32(1/448)
// (one FP32 product) and values multiplied by 448 / amax (one FP32 division); with round_scale,
// e = ceil(log2(amax * fp32(1/448))) from the product's bits, scale_inv = 2^e and values
// multiplied by 2^-e; then cast with round-to-nearest-even and saturation. The loops are written
// to vectorize; the vector paths (AVX2, AVX-512) give the same bytes as the portable one for every
// input.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cpu_features.hh"

namespace moe_ep::core {

// One block's stored scale (scale_inv) and the factor its values are multiplied by (scale),
// from the block's max |x| before the floor (NaN counts as the floor).
struct Fp8BlockScales {
  float scale_inv;
  float scale;
};
Fp8BlockScales fp8_block_scales(float amax, bool round_scale);

// Casts `hidden` (a multiple of 128) contiguous values into `q`. Block b's scale goes to
// `scales` as one byte (the UE8M0 exponent, `ue8m0`) or one FP32 at byte offset 4b.
void cast_row_fp8(const std::uint16_t* bf16, std::int64_t hidden, bool round_scale, bool ue8m0, std::uint8_t* q,
                  std::byte* scales);
void cast_row_fp8(const float* fp32, std::int64_t hidden, bool round_scale, bool ue8m0, std::uint8_t* q,
                  std::byte* scales);
// The BF16 cast on one instruction set (each gives identical bytes), for tests and benchmarks that
// compare them: false, and nothing written, where this CPU (or build) lacks it. cast_row_fp8
// takes the widest the CPU has.
bool cast_row_fp8_on(Isa isa, const std::uint16_t* bf16, std::int64_t hidden, bool round_scale, bool ue8m0,
                     std::uint8_t* q, std::byte* scales);

}  // namespace moe_ep::core
