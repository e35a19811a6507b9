// Fuzzes DLPack import: a DLTensor built from the input (rank, dtype, sizes, strides, byte
// offset, a null or a real data pointer, a missing shape array) goes through view_from_dlpack
// and Tensor::from_dlpack. An accepted view must be consistent with an independent 128-bit
// computation of its element count, strides and byte range; the elements it claims are then
// touched when they lie inside the buffer this fuzzer owns (ASan checks the claim). Imports
// always run the deleter exactly once, and an imported tensor refuses views beyond its bytes.
//
// Input layout (missing bytes read as 0): ndim (int8), dtype code, bits, lanes (uint8),
// flags, buffer size (uint16 LE), byte_offset (uint64 LE), 4 sizes and 4 strides (int64 LE).
// flags: 1 strides given, 2 data null, 4 shape null, 8 device not CPU, 16 also from_dlpack.
#include <dlpack/dlpack.h>
#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace {

using moe_ep::DType;
using moe_ep::InvalidArgument;
using moe_ep::Tensor;
using moe_ep::TensorView;
using i128 = __int128;

[[noreturn]] void violated(const char* what) {
  fmt::print(stderr, "dlpack fuzzer: {}\n", what);
  std::abort();
}

class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  template <class T>
  T take() {
    unsigned char bytes[sizeof(T)] = {};
    for (std::size_t i = 0; i < sizeof(T) && pos_ < size_; ++i) bytes[i] = data_[pos_++];
    T value;
    std::memcpy(&value, bytes, sizeof(T));
    return value;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_, pos_ = 0;
};

int deletions = 0;

struct Managed {
  DLManagedTensor managed{};
};

DLManagedTensor* new_managed(const DLTensor& t) {
  auto* m = new Managed;
  m->managed.dl_tensor = t;
  m->managed.manager_ctx = m;
  m->managed.deleter = [](DLManagedTensor* self) {
    ++deletions;
    delete static_cast<Managed*>(self->manager_ctx);
  };
  return &m->managed;
}

// Visits every element offset (in elements) of a layout with at most `limit` elements.
template <class F>
void for_each_offset(const TensorView& v, F&& f) {
  std::int64_t index[TensorView::kMaxDims] = {};
  const int n = v.ndim();
  for (;;) {
    i128 offset = 0;
    for (int d = 0; d < n; ++d) offset += static_cast<i128>(index[d]) * v.stride(d);
    f(offset);
    int d = n - 1;
    while (d >= 0 && ++index[d] == v.size(d)) index[d--] = 0;
    if (d < 0) return;
  }
}

void check_accepted(const DLTensor& t, const TensorView& v, const std::byte* buffer, std::size_t buffer_bytes) {
  if (v.ndim() != t.ndim) violated("rank differs");
  const i128 element = static_cast<i128>(moe_ep::element_size(v.dtype()));
  i128 numel = 1;
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (v.size(d) != t.shape[d]) violated("size differs");
    empty |= t.shape[d] == 0;
  }
  if (!empty)
    for (int d = 0; d < t.ndim; ++d) {
      numel *= t.shape[d];
      if (numel > INT64_MAX) violated("an element count beyond int64 was accepted");
    }
  if (empty) numel = 0;
  if (numel != v.numel()) violated("numel differs");
  if (numel * element > INT64_MAX || static_cast<i128>(v.nbytes()) != numel * element) violated("nbytes differs");
  // Strides: as given, or row-major (each stride of an accepted row-major view fits in int64,
  // so the products below fit in 128 bits).
  i128 expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    const i128 stride = t.strides != nullptr ? t.strides[d] : expected;
    if (v.stride(d) != stride) violated("stride differs");
    if (t.strides == nullptr) {
      if (expected > INT64_MAX) violated("a row-major stride beyond int64 was accepted");
      expected *= t.shape[d] == 0 ? 1 : t.shape[d];
    }
  }
  // Byte range.
  i128 low = 0, high = 0;
  if (numel > 0) {
    for (int d = 0; d < t.ndim; ++d) {
      if (v.size(d) == 1) continue;
      i128 span = 0;
      if (__builtin_mul_overflow(static_cast<i128>(v.size(d) - 1), static_cast<i128>(v.stride(d)), &span) ||
          __builtin_mul_overflow(span, element, &span))
        violated("a byte range beyond 128 bits was accepted");
      (span < 0 ? low : high) += span;
    }
    high += element;
  }
  const TensorView::ByteRange r = v.byte_range();
  if (r.begin != low || r.end != high) violated("byte range differs");
  // Data pointer: byte_offset applied; null only without elements.
  if (t.data == nullptr) {
    if (v.data() != nullptr || numel != 0) violated("null data accepted with elements");
  } else if (reinterpret_cast<std::uintptr_t>(v.data()) != reinterpret_cast<std::uintptr_t>(t.data) + t.byte_offset) {
    violated("data pointer differs");
  }
  (void)v.describe();
  (void)v.is_contiguous();
  if (numel == 0 || v.data() == nullptr || buffer == nullptr) return;
  // Touch what the view claims, when that lies inside our buffer.
  const i128 address = static_cast<i128>(reinterpret_cast<std::uintptr_t>(v.data()));
  const i128 first = static_cast<i128>(reinterpret_cast<std::uintptr_t>(buffer));
  if (address + low < first || address + high > first + static_cast<i128>(buffer_bytes)) return;
  auto* base = static_cast<std::byte*>(v.data());
  auto touch = [&](i128 offset_bytes) {
    if (offset_bytes < low || offset_bytes + element > high) violated("an element lies outside the byte range");
    std::byte* p = base + static_cast<std::ptrdiff_t>(offset_bytes);
    std::byte tmp[8];
    std::memcpy(tmp, p, static_cast<std::size_t>(element));
    std::memcpy(p, tmp, static_cast<std::size_t>(element));
  };
  if (numel <= 4096) {
    for_each_offset(v, [&](i128 offset) { touch(offset * element); });
  } else {
    touch(low);
    touch(high - element);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader in(data, size);
  DLTensor t{};
  t.ndim = in.take<std::int8_t>();
  t.dtype.code = in.take<std::uint8_t>();
  t.dtype.bits = in.take<std::uint8_t>();
  t.dtype.lanes = in.take<std::uint8_t>();
  const auto flags = in.take<std::uint8_t>();
  const std::size_t buffer_bytes = in.take<std::uint16_t>() % 4097;
  t.byte_offset = in.take<std::uint64_t>();
  std::int64_t shape[4], strides[4];
  for (auto& s : shape) s = in.take<std::int64_t>();
  for (auto& s : strides) s = in.take<std::int64_t>();
  std::vector<std::uint64_t> storage((buffer_bytes + 7) / 8 + 1);  // 8-byte aligned, never empty
  auto* buffer = reinterpret_cast<std::byte*>(storage.data());
  t.data = (flags & 2) ? nullptr : buffer;
  t.device = {(flags & 8) ? kDLCUDA : kDLCPU, 0};
  t.shape = (flags & 4) ? nullptr : shape;
  t.strides = (flags & 1) ? strides : nullptr;

  bool accepted = false;
  TensorView v;
  try {
    v = moe_ep::view_from_dlpack(t);
    accepted = true;
  } catch (const InvalidArgument&) {
  }
  if (accepted) check_accepted(t, v, buffer, buffer_bytes);

  if (flags & 16) {
    deletions = 0;
    DLManagedTensor* managed = new_managed(t);
    try {
      Tensor imported = Tensor::from_dlpack(managed);
      if (!accepted) violated("from_dlpack accepted what view_from_dlpack refused");
      if (imported.data() != v.data() || imported.numel() != v.numel()) violated("imported tensor differs");
      (void)imported.with_view(imported.view());  // its own view lies inside
      if (imported.numel() > 0) {
        // One element further on, the last byte lies beyond the imported bytes.
        auto* shifted = static_cast<std::byte*>(imported.data()) + moe_ep::element_size(imported.dtype());
        bool refused = false;
        try {
          (void)imported.with_view(TensorView(shifted, imported.dtype(), imported.shape(), imported.strides()));
        } catch (const InvalidArgument&) {
          refused = true;
        }
        if (!refused) violated("a view beyond the imported bytes was accepted");
      }
      if (deletions != 0) violated("deleted while in use");
    } catch (const InvalidArgument&) {
      if (accepted) violated("from_dlpack refused what view_from_dlpack accepted");
    }
    if (deletions != 1) violated("the deleter did not run exactly once");
  }
  return 0;
}
