// Tensors: a non-owning strided view and a reference-counted owning tensor, both exchangeable
// through DLPack.
//
// Every view names the device its bytes live on (DLPack's DLDevice): host memory (kDLCPU, or
// kDLCUDAHost for pinned memory) by default, or a CUDA device's memory (kDLCUDA, with its ordinal).
// The built-in provider moves host tensors only and refuses others by name; the CUDA provider
// (docs/cuda.md) moves device tensors.
//
// A TensorView describes memory it does not own: a data pointer, a dtype, up to six sizes and
// element strides (none: a scalar, one element at the data pointer). Library calls read input
// views and never keep them past the call (or past the returned Event, for asynchronous calls). Constructors refuse (InvalidArgument naming the
// shape) a view whose element count, byte count or byte range does not fit in int64, or whose
// bytes would wrap around the address space, so numel(), nbytes() and byte_range() of any view
// are exact. A Tensor is a view that also holds a reference on
// its storage; copying a Tensor shares the storage (as framework tensors do). Storage from
// Tensor::empty is 64-byte aligned, comes from a caching host allocator (memory is recycled, not
// returned to the kernel, so steady-state loops do not page-fault) and is uninitialised.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

#include <dlpack/dlpack.h>

#include "moe_ep/dtype.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep {

class TensorView {
 public:
  static constexpr int kMaxDims = kMaxTensorDims;  // 0-d (scalars) to 6-d (the NVFP4 scale layout)

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape);
  TensorView(void* data, DType dtype, std::span<const std::int64_t> shape);
  // Arbitrary strides, in elements.
  TensorView(void* data, DType dtype, std::span<const std::int64_t> shape,
             std::span<const std::int64_t> strides);

  bool defined() const { return ndim_ > 0 || data_ != nullptr; }
  // Where the bytes live; host memory unless set by on_device() or a DLPack import.
  DLDevice device() const { return device_; }
  bool on_host() const { return device_.device_type == kDLCPU || device_.device_type == kDLCUDAHost; }
  // The same view, describing memory on `device`.
  TensorView on_device(DLDevice device) const {
    TensorView v = *this;
    v.device_ = device;
    return v;
  }
  void* data() const { return data_; }
  template <class T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  int ndim() const { return ndim_; }
  std::int64_t size(int d) const { return shape_[d]; }
  std::int64_t stride(int d) const { return strides_[d]; }
  std::span<const std::int64_t> shape() const { return {shape_.data(), static_cast<size_t>(ndim_)}; }
  std::span<const std::int64_t> strides() const {
    return {strides_.data(), static_cast<size_t>(ndim_)};
  }
  std::int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(dtype_); }
  // The bytes the elements occupy, as offsets from data(): [begin, end). begin < 0 only with
  // negative strides; {0, 0} when there are no elements.
  struct ByteRange {
    std::int64_t begin = 0, end = 0;
  };
  ByteRange byte_range() const;
  // Row-major with no gaps (size-1 dimensions may have any stride); views without elements are
  // contiguous.
  bool is_contiguous() const;
  // Swaps two dimensions without moving data.
  TensorView transposed(int a, int b) const;
  // "bfloat16[4, 7168]" (strides are printed when not contiguous; " on cuda:0" off the host).
  std::string describe() const;

 protected:
  void check_layout() const;  // the constructors' checks (see above)

  void* data_ = nullptr;
  DType dtype_ = DType::kUInt8;
  int ndim_ = 0;
  std::array<std::int64_t, kMaxDims> shape_{};
  std::array<std::int64_t, kMaxDims> strides_{};
  DLDevice device_{kDLCPU, 0};
};

class Tensor : public TensorView {
 public:
  Tensor() = default;
  static Tensor empty(std::span<const std::int64_t> shape, DType dtype);
  static Tensor empty(std::initializer_list<std::int64_t> shape, DType dtype) {
    return empty(std::span<const std::int64_t>(shape.begin(), shape.size()), dtype);
  }
  static Tensor zeros(std::span<const std::int64_t> shape, DType dtype);
  static Tensor zeros(std::initializer_list<std::int64_t> shape, DType dtype) {
    return zeros(std::span<const std::int64_t>(shape.begin(), shape.size()), dtype);
  }
  // A uint8 [bytes] host tensor over memory that `owner` keeps alive: every Tensor made from it
  // (with_view, copies, DLPack exports) holds a reference on `owner`, so the memory outlives the
  // last of them whatever its owner does meanwhile. [begin, begin + bytes) is the storage
  // with_view checks against. InvalidArgument when owner is null, or begin is null with bytes > 0.
  static Tensor adopt(std::shared_ptr<void> owner, void* begin, std::size_t bytes);
  // A tensor sharing this one's storage, described by `view`: every byte of the view's elements
  // must lie inside the storage, and a view without elements must point into it or just past
  // its end (InvalidArgument otherwise). The storage is the block of empty()/zeros() or the
  // bytes an imported DLPack tensor describes, and stays the whole block for views of views.
  // A tensor without storage (default-constructed, or made from one) has no bytes to check
  // against: with_view then wraps `view` as is and keeps nothing alive (the caller owns that
  // memory, as with a TensorView).
  Tensor with_view(const TensorView& view) const;
  const TensorView& view() const { return *this; }
  // Number of Tensors (and DLPack exports) sharing the storage; 0 for an undefined tensor.
  long use_count() const { return storage_.use_count(); }

  // DLPack: export hands out a new reference (the consumer calls deleter); import takes
  // ownership of `managed` and calls its deleter when the last reference goes away.
  DLManagedTensor* to_dlpack() const;
  static Tensor from_dlpack(DLManagedTensor* managed);

 private:
  std::shared_ptr<void> storage_;
  // The bytes of the storage (meaningful when storage_ holds a reference).
  std::uintptr_t storage_begin_ = 0;
  std::size_t storage_bytes_ = 0;
};

// A non-owning view of a DLPack tensor (host or CUDA memory; no lanes; dtypes listed in docs/).
// "cuda:1", "cpu", "cuda_host": how messages name a device.
std::string device_name(DLDevice device);
TensorView view_from_dlpack(const DLTensor& tensor);

// This process's caching host allocator (Tensor::empty's storage).
struct HostAllocatorStats {
  std::size_t mapped_bytes = 0;  // currently mapped by the large-block path (live + cached)
  std::size_t cached_bytes = 0;  // mapped but free, ready for reuse
  std::size_t num_maps = 0;      // mmap calls since start (a steady-state loop keeps this flat)
};
HostAllocatorStats host_allocator_stats();

}  // namespace moe_ep
