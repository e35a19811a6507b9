#include "core/checks.hh"

#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <numeric>

namespace moe_ep::core {

void expect_device(std::string_view context, std::string_view name, const TensorView& t, DLDevice device) {
  if (!t.defined()) return;
  const bool host_wanted = device.device_type == kDLCPU || device.device_type == kDLCUDAHost;
  if (host_wanted ? t.on_host()
                  : t.device().device_type == device.device_type && t.device().device_id == device.device_id)
    return;
  if (host_wanted)
    fail(context, "{} lives on {} ({} is {}); this provider moves host tensors (the cuda provider moves device "
         "tensors: docs/cuda.md)", name, device_name(t.device()), name, t.describe());
  fail(context, "{} lives on {}, expected {} ({} is {})", name, device_name(t.device()), device_name(device), name,
       t.describe());
}

void expect_tensor(std::string_view context, std::string_view name, const TensorView& t, DType dtype,
                   std::initializer_list<std::int64_t> shape, DLDevice device) {
  if (!t.defined()) fail(context, "{} is missing", name);
  expect_device(context, name, t, device);
  if (t.dtype() != dtype)
    fail(context, "{} has dtype {}, expected {} ({} is {})", name, dtype_name(t.dtype()), dtype_name(dtype),
         name, t.describe());
  if (t.ndim() != static_cast<int>(shape.size()))
    fail(context, "{} has {} dimensions, expected {} ({} is {})", name, t.ndim(), shape.size(), name,
         t.describe());
  if (t.data() == nullptr && t.numel() > 0) fail(context, "{} has a null data pointer", name);
  int d = 0;
  for (std::int64_t expected : shape) {
    if (expected >= 0 && t.size(d) != expected)
      fail(context, "{} has size {} in dimension {}, expected {} ({} is {})", name, t.size(d), d, expected,
           name, t.describe());
    ++d;
  }
  expect_non_overlapping(context, name, t);
}

int int_size(std::string_view context, std::string_view name, const TensorView& t, int d) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int32_t>::max();
  if (t.size(d) > kMax)
    fail(context, "{} has size {} in dimension {}, more than {} ({} is {})", name, t.size(d), d, kMax, name,
         t.describe());
  return static_cast<int>(t.size(d));
}

void expect_non_overlapping(std::string_view context, std::string_view name, const TensorView& t) {
  if (t.numel() <= 1) return;
  // Visit dimensions from the smallest stride up (insertion sort: at most kMaxDims entries).
  std::array<int, TensorView::kMaxDims> order{0, 1, 2, 3, 4, 5};
  const int n = t.ndim();
  for (int i = 1; i < n; ++i)
    for (int j = i; j > 0 && t.stride(order[j]) < t.stride(order[j - 1]); --j) std::swap(order[j], order[j - 1]);
  std::int64_t reach = 1;  // elements spanned by the inner dimensions
  bool beyond = false;     // reach exceeds int64: no further dimension of size > 1 fits
  for (int i = 0; i < n; ++i) {
    const int d = order[i];
    if (t.size(d) == 1) continue;
    if (beyond || t.stride(d) < reach)
      fail(context, "{} has overlapping or negative strides ({})", name, t.describe());
    beyond = __builtin_mul_overflow(t.stride(d), t.size(d), &reach);
  }
}

void expect_rows_contiguous(std::string_view context, std::string_view name, const TensorView& t) {
  const int last = t.ndim() - 1;
  if (t.size(last) > 1 && t.stride(last) != 1)
    fail(context, "{} must have stride 1 in its last dimension ({} is {})", name, name, t.describe());
}

void expect_contiguous(std::string_view context, std::string_view name, const TensorView& t) {
  if (!t.is_contiguous()) fail(context, "{} must be contiguous ({} is {})", name, name, t.describe());
}

}  // namespace moe_ep::core
