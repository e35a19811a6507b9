// Per-row FP8 E4M3 cast with per-128-element block scales: the rule of moe_ep/convert.hpp
// (scale_inv = max(amax, floor) / 448, optionally rounded up to a power of two; values are
// multiplied by 448 / max(amax, floor), or by 1 / scale_inv when rounded, then cast with
// round-to-nearest-even and saturation). NaN inputs are ignored by amax. The loops are written
// to vectorize; results are identical to the scalar rule for every input.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_ep::core {

// Casts `hidden` (a multiple of 128) contiguous values into `q`. Block b's scale goes to
// `scales` as one byte (the UE8M0 exponent, `ue8m0`) or one FP32 at byte offset 4b.
void cast_row_fp8(const std::uint16_t* bf16, std::int64_t hidden, bool round_scale, bool ue8m0, std::uint8_t* q,
                  std::byte* scales);
void cast_row_fp8(const float* fp32, std::int64_t hidden, bool round_scale, bool ue8m0, std::uint8_t* q,
                  std::byte* scales);
// The portable path of the BF16 cast, for tests that compare it with the vector one.
void cast_row_fp8_generic(const std::uint16_t* bf16, std::int64_t hidden, bool round_scale, bool ue8m0,
                          std::uint8_t* q, std::byte* scales);

}  // namespace moe_ep::core
