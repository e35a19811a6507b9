// NumPy .npy files (format version 1.0), so dumps can be checked by independent tools.
//
// Contiguous data is written in C order, little-endian. NumPy has no bfloat16 or float8 types:
// bfloat16 tensors are stored as '<u2' (the raw bit patterns) and float8_e4m3fn as '|u1' (the
// codes); docs/dump-format.md lists how to decode them. read_npy accepts what write_npy writes.
#pragma once

#include <string>

#include "moe_ep/tensor.hpp"

namespace moe_ep::core {

void write_npy(const std::string& path, const TensorView& t);
// `as` reinterprets '<u2' as bfloat16 or '|u1' as float8 (the dtype write_npy was given).
Tensor read_npy(const std::string& path, DType as);

}  // namespace moe_ep::core
