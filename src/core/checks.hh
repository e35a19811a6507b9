// Argument checks shared by every layer. Each failure throws InvalidArgument whose message starts
// with the caller's context ("[rank 3] dispatch"), then names the argument, the value and the
// accepted limit.
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <string_view>

#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::core {

template <class... Args>
[[noreturn]] void fail(std::string_view context, fmt::format_string<Args...> format, Args&&... args) {
  throw InvalidArgument(fmt::format("{}: {}", context, fmt::format(format, std::forward<Args>(args)...)));
}

// Size d of t as an int (the engine indexes rows, columns and experts with int32): a size above
// INT32_MAX is refused, never truncated.
int int_size(std::string_view context, std::string_view name, const TensorView& t, int d);
// Size -1 in `shape` accepts any size in that dimension. `device`: where the bytes must live
// (kDLCPU accepts any host memory, pinned included); the message names both devices.
void expect_tensor(std::string_view context, std::string_view name, const TensorView& t, DType dtype,
                   std::initializer_list<std::int64_t> shape, DLDevice device = {kDLCPU, 0});
void expect_device(std::string_view context, std::string_view name, const TensorView& t, DLDevice device);
// The last dimension has stride 1 and rows do not overlap.
void expect_rows_contiguous(std::string_view context, std::string_view name, const TensorView& t);
void expect_contiguous(std::string_view context, std::string_view name, const TensorView& t);
// Strides are non-negative and consistent with the sizes (no two elements alias).
void expect_non_overlapping(std::string_view context, std::string_view name, const TensorView& t);

}  // namespace moe_ep::core
