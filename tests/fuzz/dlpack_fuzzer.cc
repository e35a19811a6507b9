// Fuzzes DLPack import: a DLTensor built from the input (rank, dtype, sizes, strides, byte
// offset, a null or a real data pointer, a missing shape array) goes through view_from_dlpack
// and Tensor::from_dlpack. An accepted view must be consistent with an independent 128-bit
// computation of its element count, strides and byte range; the elements it claims are then
// touched when they lie inside the buffer this fuzzer owns (ASan checks the claim). Imports
// always run the deleter exactly once, and an imported tensor refuses views beyond its bytes.
//
// With from_dlpack, a second view of the imported tensor (with_view) is accepted exactly when
// an independent computation puts its bytes inside the imported ones.
//
// Input layout (missing bytes read as 0): ndim (int8), dtype code, bits, lanes (uint8),
// flags, buffer size (uint16 LE), byte_offset (uint64 LE), 6 sizes and 6 strides (int64 LE);
// then the second view: dtype index, rank - 1 (mod 4), flags (1: null data), its data's
// offset in bytes from the imported bytes' first (int16 LE), 4 sizes (uint8), 4 strides (int8).
// flags: 1 strides given, 2 data null, 4 shape null, 8 device not CPU, 16 also from_dlpack.
#include <dlpack/dlpack.h>
#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <span>
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

constexpr DType kTypes[] = {DType::kBool, DType::kUInt8, DType::kInt32, DType::kInt64,
                            DType::kBF16, DType::kFP32,  DType::kFP8E4M3, DType::kFP16,
                            DType::kInt8, DType::kInt16};

// A view of `imported` described by the input: with_view must accept it exactly when its bytes
// lie inside the imported bytes (or, without elements, it points into them or just past them).
void check_subview(const Tensor& imported, Reader& in, const std::byte* buffer, std::size_t buffer_bytes) {
  const DType dtype = kTypes[in.take<std::uint8_t>() % std::size(kTypes)];
  const int ndim = 1 + in.take<std::uint8_t>() % 4;
  const bool null_data = (in.take<std::uint8_t>() & 1) != 0;
  const auto offset = in.take<std::int16_t>();
  std::int64_t shape[4], strides[4];
  for (auto& x : shape) x = in.take<std::uint8_t>();
  for (auto& x : strides) x = in.take<std::int8_t>();
  const TensorView::ByteRange imported_range = imported.byte_range();
  const i128 first = static_cast<i128>(reinterpret_cast<std::uintptr_t>(imported.data())) + imported_range.begin;
  const i128 last = static_cast<i128>(reinterpret_cast<std::uintptr_t>(imported.data())) + imported_range.end;
  const i128 address = null_data ? 0 : first + offset;
  if (address < 0) return;
  const std::span<const std::int64_t> s(shape, static_cast<std::size_t>(ndim)), st(strides, static_cast<std::size_t>(ndim));
  TensorView view;
  try {
    // On the storage's device: a view naming another device is refused whatever its bytes.
    view = TensorView(reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), dtype, s, st)
               .on_device(imported.device());
  } catch (const InvalidArgument&) {
    return;  // a layout no view may have (its bytes would wrap around the address space)
  }
  const i128 element = static_cast<i128>(moe_ep::element_size(dtype));
  i128 numel = 1, low = 0, high = element;
  for (int d = 0; d < ndim; ++d) {
    numel *= shape[d];
    if (shape[d] > 1) (strides[d] < 0 ? low : high) += static_cast<i128>(shape[d] - 1) * strides[d] * element;
  }
  const bool inside = numel == 0 ? address >= first && address <= last
                                 : !null_data && address + low >= first && address + high <= last;
  bool accepted = false;
  try {
    (void)imported.with_view(view);
    accepted = true;
  } catch (const InvalidArgument&) {
  }
  if (accepted != inside) violated(inside ? "a view inside the storage was refused" : "a view outside the storage was accepted");
  // Inside our own buffer: touch its elements.
  const i128 mine = static_cast<i128>(reinterpret_cast<std::uintptr_t>(buffer));
  if (accepted && numel > 0 && first >= mine && last <= mine + static_cast<i128>(buffer_bytes)) {
    auto* base = static_cast<std::byte*>(view.data());
    auto touch = [&](i128 offset_bytes) {
      std::byte* p = base + static_cast<std::ptrdiff_t>(offset_bytes);
      std::byte tmp[8];
      std::memcpy(tmp, p, static_cast<std::size_t>(element));
      std::memcpy(p, tmp, static_cast<std::size_t>(element));
    };
    if (numel <= 4096) {
      for_each_offset(view, [&](i128 index) { touch(index * element); });
    } else {
      touch(low);
      touch(high - element);
    }
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
  std::int64_t shape[TensorView::kMaxDims], strides[TensorView::kMaxDims];  // ranks above are refused unread
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
      check_subview(imported, in, buffer, buffer_bytes);
      if (deletions != 0) violated("deleted while in use");
    } catch (const InvalidArgument&) {
      if (accepted) violated("from_dlpack refused what view_from_dlpack accepted");
    }
    if (deletions != 1) violated("the deleter did not run exactly once");
  }
  return 0;
}
