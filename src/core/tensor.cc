#include "moe_ep/tensor.hpp"

#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>

#include "core/host_allocator.hh"
#include "moe_ep/error.hpp"

namespace moe_ep {
namespace {

// DLPack >= 1.1 type code for float8_e4m3fn (the 0.6 header Debian ships predates FP8 codes).
constexpr std::uint8_t kDLFloat8E4M3FnCode = 10;
// DLPack >= 0.8 type code for bool.
constexpr std::uint8_t kDLBoolCode = 6;

DLDataType to_dl(DType t) {
  switch (t) {
    case DType::kBool:
      return {kDLBoolCode, 8, 1};
    case DType::kUInt8:
      return {kDLUInt, 8, 1};
    case DType::kInt32:
      return {kDLInt, 32, 1};
    case DType::kInt64:
      return {kDLInt, 64, 1};
    case DType::kBF16:
      return {kDLBfloat, 16, 1};
    case DType::kFP32:
      return {kDLFloat, 32, 1};
    case DType::kFP8E4M3:
      return {kDLFloat8E4M3FnCode, 8, 1};
    case DType::kFP16:
      return {kDLFloat, 16, 1};
    case DType::kInt8:
      return {kDLInt, 8, 1};
    case DType::kInt16:
      return {kDLInt, 16, 1};
  }
  return {kDLUInt, 8, 1};
}

DType from_dl(DLDataType t) {
  if (t.lanes != 1) throw InvalidArgument(fmt::format("DLPack tensor has {} lanes; only 1 is supported", t.lanes));
  if (t.code == kDLBoolCode && t.bits == 8) return DType::kBool;
  if (t.code == kDLUInt && t.bits == 8) return DType::kUInt8;
  if (t.code == kDLInt && t.bits == 32) return DType::kInt32;
  if (t.code == kDLInt && t.bits == 64) return DType::kInt64;
  if (t.code == kDLBfloat && t.bits == 16) return DType::kBF16;
  if (t.code == kDLFloat && t.bits == 32) return DType::kFP32;
  if (t.code == kDLFloat8E4M3FnCode && t.bits == 8) return DType::kFP8E4M3;
  if (t.code == kDLFloat && t.bits == 16) return DType::kFP16;
  if (t.code == kDLInt && t.bits == 8) return DType::kInt8;
  if (t.code == kDLInt && t.bits == 16) return DType::kInt16;
  throw InvalidArgument(fmt::format("DLPack dtype (code {}, bits {}) is not supported", t.code, t.bits));
}

void check_ndim(std::size_t ndim) {
  if (ndim > static_cast<std::size_t>(TensorView::kMaxDims))
    throw InvalidArgument(fmt::format("tensor rank {} is outside [0, {}]", ndim, TensorView::kMaxDims));
}

}  // namespace

TensorView::TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape)
    : TensorView(data, dtype, std::span<const std::int64_t>(shape.begin(), shape.size())) {}

TensorView::TensorView(void* data, DType dtype, std::span<const std::int64_t> shape)
    : data_(data), dtype_(dtype), ndim_(static_cast<int>(shape.size())) {
  check_ndim(shape.size());
  std::int64_t stride = 1;
  bool overflow = false;  // the stride of the next (outer) dimension does not fit
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (shape[d] < 0) throw InvalidArgument(fmt::format("tensor size {} of dim {} is negative", shape[d], d));
    if (overflow)
      throw InvalidArgument(fmt::format("tensor {}[{}]: its row-major strides do not fit in 64 bits", dtype_name(dtype),
                                        fmt::join(shape, ", ")));
    shape_[d] = shape[d];
    strides_[d] = stride;
    overflow = __builtin_mul_overflow(stride, shape[d] == 0 ? 1 : shape[d], &stride);
  }
  check_layout();
}

TensorView::TensorView(void* data, DType dtype, std::span<const std::int64_t> shape,
                       std::span<const std::int64_t> strides)
    : data_(data), dtype_(dtype), ndim_(static_cast<int>(shape.size())) {
  check_ndim(shape.size());
  if (strides.size() != shape.size())
    throw InvalidArgument(fmt::format("tensor has {} sizes but {} strides", shape.size(), strides.size()));
  for (int d = 0; d < ndim_; ++d) {
    if (shape[d] < 0) throw InvalidArgument(fmt::format("tensor size {} of dim {} is negative", shape[d], d));
    shape_[d] = shape[d];
    strides_[d] = strides[d];
  }
  check_layout();
}

namespace {

// Element count and byte range of a layout, each computed with overflow checks; the reason when
// one does not fit in int64.
struct Measured {
  std::int64_t numel = 0;
  TensorView::ByteRange bytes;
  const char* overflow = nullptr;
};

Measured measure(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, std::int64_t element) {
  Measured m;
  for (std::int64_t size : shape)
    if (size == 0) return m;  // no elements: no bytes, whatever the other sizes
  m.numel = 1;
  for (std::int64_t size : shape)
    if (__builtin_mul_overflow(m.numel, size, &m.numel)) {
      m.overflow = "its element count does not fit in 64 bits";
      return m;
    }
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(m.numel, element, &bytes)) {
    m.overflow = "its byte count does not fit in 64 bits";
    return m;
  }
  // Lowest and highest element, in bytes from the first.
  std::int64_t low = 0, high = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;  // its stride is never applied
    std::int64_t span = 0;
    if (__builtin_mul_overflow(shape[d] - 1, strides[d], &span) || __builtin_mul_overflow(span, element, &span) ||
        __builtin_add_overflow(span < 0 ? low : high, span, span < 0 ? &low : &high)) {
      m.overflow = "its byte range does not fit in 64 bits";
      return m;
    }
  }
  if (__builtin_add_overflow(high, element, &high)) {
    m.overflow = "its byte range does not fit in 64 bits";
    return m;
  }
  m.bytes = {low, high};
  return m;
}

}  // namespace

void TensorView::check_layout() const {
  const auto element = static_cast<std::int64_t>(element_size(dtype_));
  const Measured m = measure(shape(), strides(), element);
  const char* problem = m.overflow;
  if (problem == nullptr && data_ != nullptr && m.numel > 0) {
    // The addresses of the first and last byte exist: data + begin >= 0, data + end <= max.
    const auto address = reinterpret_cast<std::uintptr_t>(data_);
    const auto below = static_cast<std::uintptr_t>(-(m.bytes.begin + 1)) + 1;  // -begin, without overflow
    std::uintptr_t last = 0;
    if ((m.bytes.begin < 0 && address < below) ||
        __builtin_add_overflow(address, static_cast<std::uintptr_t>(m.bytes.end), &last))
      problem = "its bytes wrap around the address space";
  }
  if (problem != nullptr)
    throw InvalidArgument(fmt::format("tensor {}[{}] strides ({}) at {}: {}", dtype_name(dtype_), fmt::join(shape(), ", "),
                                      fmt::join(strides(), ", "), data_, problem));
}

std::int64_t TensorView::numel() const {
  if (ndim_ == 0) return data_ != nullptr ? 1 : 0;  // a scalar, or no tensor
  for (int d = 0; d < ndim_; ++d)
    if (shape_[d] == 0) return 0;
  std::int64_t n = 1;
  for (int d = 0; d < ndim_; ++d)
    if (__builtin_mul_overflow(n, shape_[d], &n))  // refused at construction
      throw StateError(fmt::format("tensor {}[{}]: element count overflow", dtype_name(dtype_), fmt::join(shape(), ", ")));
  return n;
}

TensorView::ByteRange TensorView::byte_range() const {
  return measure(shape(), strides(), static_cast<std::int64_t>(element_size(dtype_))).bytes;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;
  std::int64_t expected = 1;  // partial products of a count that fits: no overflow
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

TensorView TensorView::transposed(int a, int b) const {
  if (a < 0 || b < 0 || a >= ndim_ || b >= ndim_)
    throw InvalidArgument(fmt::format("transposed({}, {}) on a rank-{} tensor", a, b, ndim_));
  TensorView v = *this;
  std::swap(v.shape_[a], v.shape_[b]);
  std::swap(v.strides_[a], v.strides_[b]);
  return v;
}

std::string TensorView::describe() const {
  if (!defined()) return "<undefined>";
  std::string s = fmt::format("{}[{}]", dtype_name(dtype_), fmt::join(shape(), ", "));
  if (!is_contiguous()) s += fmt::format(" strides ({})", fmt::join(strides(), ", "));
  if (device_.device_type != kDLCPU) s += " on " + device_name(device_);
  return s;
}

Tensor Tensor::empty(std::span<const std::int64_t> shape, DType dtype) {
  Tensor t;
  static_cast<TensorView&>(t) = TensorView(nullptr, dtype, shape);
  const std::size_t bytes = shape.empty() ? element_size(dtype) : t.nbytes();  // a scalar has one element
  t.storage_ = core::allocate_host(bytes);
  t.data_ = t.storage_.get();
  t.storage_begin_ = reinterpret_cast<std::uintptr_t>(t.data_);
  t.storage_bytes_ = bytes;
  return t;
}

Tensor Tensor::zeros(std::span<const std::int64_t> shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::adopt(std::shared_ptr<void> owner, void* begin, std::size_t bytes) {
  if (owner == nullptr) throw InvalidArgument("Tensor::adopt: owner is null");
  if (begin == nullptr && bytes > 0)
    throw InvalidArgument(fmt::format("Tensor::adopt: begin is null for {} bytes", bytes));
  if (bytes > static_cast<std::size_t>(INT64_MAX))
    throw InvalidArgument(fmt::format("Tensor::adopt: {} bytes do not fit in int64", bytes));
  Tensor t;
  static_cast<TensorView&>(t) = TensorView(begin, DType::kUInt8, {static_cast<std::int64_t>(bytes)});
  t.storage_ = std::move(owner);
  t.storage_begin_ = reinterpret_cast<std::uintptr_t>(begin);
  t.storage_bytes_ = bytes;
  return t;
}

Tensor Tensor::with_view(const TensorView& view) const {
  if (use_count() > 0 && (view.device().device_type != device_.device_type || view.device().device_id != device_.device_id))
    throw InvalidArgument(fmt::format("Tensor::with_view: the view {} names another device than the storage ({})",
                                      view.describe(), device_name(device_)));
  if (use_count() > 0) {
    // Addresses of the view's first and last byte exist (checked when the view was made).
    const auto address = reinterpret_cast<std::uintptr_t>(view.data());
    const TensorView::ByteRange r = view.byte_range();
    const std::uintptr_t first = address + static_cast<std::uintptr_t>(r.begin), last = address + static_cast<std::uintptr_t>(r.end);
    const std::uintptr_t end = storage_begin_ + storage_bytes_;
    // A view with elements needs a data pointer (a null one would make first wrap around).
    const bool inside = view.numel() == 0 ? address >= storage_begin_ && address <= end
                                          : view.data() != nullptr && first >= storage_begin_ && last <= end;
    if (!inside)
      throw InvalidArgument(fmt::format(
          "Tensor::with_view: the view {} covers bytes [{}, {}) of a storage of {} bytes (offsets from its start)",
          view.describe(), static_cast<std::int64_t>(first - storage_begin_),
          static_cast<std::int64_t>(last - storage_begin_), storage_bytes_));
  }
  Tensor t;
  static_cast<TensorView&>(t) = view;
  t.storage_ = storage_;
  t.storage_begin_ = storage_begin_;
  t.storage_bytes_ = storage_bytes_;
  return t;
}

namespace {

struct DLPackExport {
  DLManagedTensor managed;
  Tensor keep_alive;
  std::array<std::int64_t, TensorView::kMaxDims> shape;
  std::array<std::int64_t, TensorView::kMaxDims> strides;
};

}  // namespace

DLManagedTensor* Tensor::to_dlpack() const {
  auto* e = new DLPackExport{};
  e->keep_alive = *this;
  for (int d = 0; d < ndim(); ++d) {
    e->shape[d] = size(d);
    e->strides[d] = stride(d);
  }
  DLTensor& t = e->managed.dl_tensor;
  t.data = data();
  t.device = device();
  t.ndim = ndim();
  t.dtype = to_dl(dtype());
  t.shape = e->shape.data();
  t.strides = e->strides.data();
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = [](DLManagedTensor* self) { delete static_cast<DLPackExport*>(self->manager_ctx); };
  return &e->managed;
}

Tensor Tensor::from_dlpack(DLManagedTensor* managed) {
  if (managed == nullptr) throw InvalidArgument("from_dlpack: managed tensor is null");
  TensorView v;
  try {
    v = view_from_dlpack(managed->dl_tensor);
  } catch (...) {
    if (managed->deleter) managed->deleter(managed);
    throw;
  }
  Tensor t;
  static_cast<TensorView&>(t) = v;
  t.storage_ = std::shared_ptr<void>(managed, [](void* p) {
    auto* m = static_cast<DLManagedTensor*>(p);
    if (m->deleter) m->deleter(m);
  });
  // All that is known of the producer's memory: the bytes the tensor describes.
  const TensorView::ByteRange r = v.byte_range();
  t.storage_begin_ = reinterpret_cast<std::uintptr_t>(v.data()) + static_cast<std::uintptr_t>(r.begin);
  t.storage_bytes_ = static_cast<std::size_t>(r.end - r.begin);
  return t;
}

std::string device_name(DLDevice device) {
  switch (device.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDAHost:
      return "cuda_host";
    case kDLCUDA:
      return fmt::format("cuda:{}", device.device_id);
    default:
      return fmt::format("device type {} id {}", static_cast<int>(device.device_type), device.device_id);
  }
}

TensorView view_from_dlpack(const DLTensor& tensor) {
  if (tensor.device.device_type != kDLCPU && tensor.device.device_type != kDLCUDAHost &&
      tensor.device.device_type != kDLCUDA)
    throw InvalidArgument(fmt::format("DLPack tensor lives on device type {}; moe-ep takes CPU, CUDA-host and CUDA memory",
                                      static_cast<int>(tensor.device.device_type)));
  if (tensor.device.device_id < 0)
    throw InvalidArgument(fmt::format("DLPack tensor on device type {} has a negative device id {}",
                                      static_cast<int>(tensor.device.device_type), tensor.device.device_id));
  if (tensor.ndim < 0 || tensor.ndim > TensorView::kMaxDims)
    throw InvalidArgument(fmt::format("DLPack tensor rank {} is outside [0, {}]", tensor.ndim, TensorView::kMaxDims));
  const DType dtype = from_dl(tensor.dtype);
  if (tensor.shape == nullptr && tensor.ndim > 0)
    throw InvalidArgument(fmt::format("DLPack tensor of rank {} has no shape array (shape is null)", tensor.ndim));
  const std::span<const std::int64_t> shape(tensor.shape, static_cast<std::size_t>(tensor.ndim));
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (shape[d] < 0)
      throw InvalidArgument(fmt::format("DLPack tensor shape [{}] has a negative size in dimension {}",
                                        fmt::join(shape, ", "), d));
  // Null strides: row-major. The layout is checked (sizes, strides, byte range) before any
  // address is formed from the data pointer.
  auto make = [&](void* data) {
    const TensorView v = tensor.strides == nullptr
                             ? TensorView(data, dtype, shape)
                             : TensorView(data, dtype, shape, std::span<const std::int64_t>(tensor.strides, shape.size()));
    return v.on_device(tensor.device);
  };
  const TensorView layout = make(nullptr);
  if (tensor.data == nullptr) {
    if (layout.numel() > 0 || tensor.ndim == 0 || tensor.byte_offset != 0)  // a scalar has an element
      throw InvalidArgument(fmt::format("DLPack tensor {} has a null data pointer (byte_offset {}): only a tensor "
                                        "without elements may, with byte_offset 0",
                                        layout.describe(), tensor.byte_offset));
    return layout;
  }
  std::uintptr_t address = 0;
  if (__builtin_add_overflow(reinterpret_cast<std::uintptr_t>(tensor.data), tensor.byte_offset, &address))
    throw InvalidArgument(fmt::format("DLPack tensor {}: byte_offset {} from data {} wraps around the address space",
                                      layout.describe(), tensor.byte_offset, tensor.data));
  return make(reinterpret_cast<void*>(address));  // also checks that its bytes do not wrap
}

}  // namespace moe_ep
