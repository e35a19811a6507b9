// LogFMT-10, written from its definition (docs/quantized-formats.md) with a bit writer and plain
// loops, sharing no code with src/. Blocks of 128 channels carry (amax, amin) of |x| as BF16;
// chunks of 256 * U elements (U = 4 when H % 1024 == 0, else 2) travel as LogFMT when every block
// in them has log2(amax) < 0 and ln = max(log2(amin), log2(amax) - 32) < log2(amax), else as
// BF16. A LogFMT element is 9 bits of code, the 16 sign bits of each group of 16 after its codes.
// log2 and exp2 are the codec's own (fixed polynomials in FP32, the definitions in the doc).
#pragma once

#include <cstdint>
#include <vector>

namespace moe_ep::reference {

// The codec's log2 and exp2, FP32 operation by operation as the doc states them.
float logfmt_log2(float v);
float logfmt_exp2(float x);
std::vector<std::uint8_t> logfmt_encode(const std::uint16_t* bf16, int hidden);
std::vector<float> logfmt_decode(const std::vector<std::uint8_t>& bytes, int hidden);
// DeepEP's calc_diff: 1 - 2 sum(x y) / sum(x^2 + y^2), in double (0 for identical inputs).
double calc_diff(const std::vector<double>& x, const std::vector<double>& y);

}  // namespace moe_ep::reference
