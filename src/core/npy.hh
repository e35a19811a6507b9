// NumPy .npy files (format version 1.0), so dumps can be checked by independent tools.
//
// Contiguous data is written in C order, little-endian. NumPy has no bfloat16 or float8 types:
// bfloat16 tensors are stored as '<u2' (the raw bit patterns) and float8_e4m3fn as '|u1' (the
// codes); docs/dump-format.md lists how to decode them. read_npy accepts what write_npy writes:
// a version-1.0 file whose header is a dict of exactly 'descr' (the dtype `as` is stored as),
// 'fortran_order': False and 'shape' (a tuple of 1 to 4 non-negative sizes), followed by exactly
// the bytes the shape needs. Anything else (malformed header, a size that does not fit in 64
// bits, a header or data cut short, trailing bytes) is a moe_ep::Error naming the file and the
// problem; nothing is allocated before the file is known to hold the data.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "moe_ep/tensor.hpp"

namespace moe_ep::core {

void write_npy(const std::string& path, const TensorView& t);
// `as` reinterprets '<u2' as bfloat16 or '|u1' as float8 (the dtype write_npy was given).
Tensor read_npy(const std::string& path, DType as);
// The same from the bytes of a file in memory; `name` stands for the file in messages.
Tensor read_npy(std::span<const std::byte> bytes, DType as, const std::string& name);

}  // namespace moe_ep::core
