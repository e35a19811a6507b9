// Per-row NVFP4 cast: 16-element blocks, one scale byte per block, two E2M1 values per byte
// (docs/quantized-formats.md). Per block: vmax = max |x| (NaN ignored), then either
//  - E4M3 scales: sf = e4m3(gs * (vmax * (1/6))), out_scale = sf != 0 ? 1 / (sf * (1/gs)) : 0;
//  - UE8M0 scales (gs ignored): sf = ue8m0_ceil(vmax * (1/6)), out_scale = 2^(127 - sf), or 1 when
//    sf = 0;
// values q = e2m1(x * out_scale) with the chosen rounding; element 2i in the low nibble of byte i.
// All arithmetic is IEEE FP32 in that order (a GPU's approximate reciprocals may differ by one
// code on ties).
#pragma once

#include <cstdint>

#include "core/cpu_features.hh"
#include <optional>

#include "moe_ep/dtype.hpp"

namespace moe_ep::core {

struct Nvfp4Cast {
  float global_scale = 1.0f;  // gs; unused with ue8m0
  bool ue8m0 = false;
  E2M1Rounding rounding = E2M1Rounding::kNearestEven;
};

// The rounding asked for, or MOE_EP_NVFP4_ROUNDING's.
E2M1Rounding nvfp4_rounding(std::optional<E2M1Rounding> asked);

// Casts `hidden` (a multiple of 16) BF16 values: `packed` gets hidden / 2 bytes, `scales` one byte
// per block (the E4M3 code, or the UE8M0 exponent).
void cast_row_nvfp4(const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast, std::uint8_t* packed,
                    std::uint8_t* scales);
// The same cast on one instruction set (each gives identical bytes), for tests and benchmarks that
// compare them: false, and nothing written, where this CPU (or build) lacks it. cast_row_nvfp4
// takes the widest the CPU has.
bool cast_row_nvfp4_on(Isa isa, const std::uint16_t* bf16, std::int64_t hidden, const Nvfp4Cast& cast,
                       std::uint8_t* packed, std::uint8_t* scales);

}  // namespace moe_ep::core
