// CudaExec: ElasticDevice's executor on a GPU. One non-blocking communication stream per rank;
// each step is a grid-stride kernel over its indices; scans are CUB device-wide exclusive sums of
// integers (exact, so the same on every run);
// memory is device memory (cudaMalloc for the symmetric region, which CUDA IPC can export; the
// rank's own stream-ordered pool, which keeps freed memory for later calls, for handles, outputs
// and per-call scratch). Output tensors are DLPack
// tensors on the device; their memory is released on the communication stream after the work
// queued on the caller's stream at release time. Errors of the runtime become moe_ep errors that
// name the call and the device.
#pragma once

#include <cub/device/device_scan.cuh>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <dlpack/dlpack.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

#include "core/arith.hh"
#include "cuda/device_common.hh"
#include "cuda/executor.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::cuda {

inline void check_cuda(cudaError_t e, const char* what, int device) {
  if (e != cudaSuccess)
    throw ResourceError(fmt::format("cuda provider: {} on cuda:{} failed: {} ({})", what, device,
                                    cudaGetErrorString(e), cudaGetErrorName(e)));
}

// Whether a CUDA context may already exist in this process: libcuda is loaded and a device's
// primary context is active (contexts made with cuCtxCreate are not seen).
inline bool primary_context_active() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // not loaded: no context can exist
  if (lib == nullptr) return false;
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  using State = int (*)(int, unsigned*, int*);
  auto init = reinterpret_cast<Init>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<Count>(dlsym(lib, "cuDeviceGetCount"));
  auto state = reinterpret_cast<State>(dlsym(lib, "cuDevicePrimaryCtxGetState"));
  bool active = init == nullptr || count == nullptr || state == nullptr;  // cannot tell: assume one
  int n = 0;
  if (!active && init(0) == 0 && count(&n) == 0)
    for (int d = 0; d < n && !active; ++d) {
      unsigned flags = 0;
      int on = 0;
      active = state(d, &flags, &on) != 0 || on != 0;
    }
  dlclose(lib);
  return active;
}

// The hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) each device gives this process: the value in
// force when its context was made, 8 when unset. Settled at the first call: if the variable is
// unset and no context exists yet, it is set to 32 first (the most CUDA gives).
inline int hardware_queues() {
  static const int queues = [] {
    const char* given = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    if (given == nullptr || *given == 0) {
      if (primary_context_active()) return 8;
      setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
      return 32;
    }
    const int n = std::atoi(given);
    return n < 1 ? 8 : std::min(n, 32);
  }();
  return queues;
}

template <class F>
__global__ void each_kernel(std::int64_t n, F f) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) f(i);
}

class CudaExec {
 public:
  explicit CudaExec(int device) : device_(device) {
    set();
    cudaStream_t s;
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", device_);
    const int dev = device_;
    stream_ = std::shared_ptr<CUstream_st>(s, [dev](cudaStream_t q) {
      cudaSetDevice(dev);
      cudaStreamSynchronize(q);
      cudaStreamDestroy(q);
    });
    check_cuda(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device_), "cudaDeviceGetAttribute", device_);
    // The rank's own stream-ordered pool, which keeps what it freed for the next calls (a release
    // threshold of all memory: the default pool's 0 returns it to the driver at every
    // synchronization); released when the last allocation from it is freed.
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    cudaMemPool_t pool;
    check_cuda(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate", device_);
    pool_ = std::shared_ptr<CUmemPoolHandle_st>(pool, [](cudaMemPool_t q) { cudaMemPoolDestroy(q); });
    std::uint64_t keep = ~std::uint64_t{0};
    check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute", device_);
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&mirror_), sizeof(std::uint64_t), cudaHostAllocMapped),
               "cudaHostAlloc (error word)", device_);
    *mirror_ = 0;
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mirror_device_), mirror_, 0), "cudaHostGetDevicePointer",
               device_);
    check_cuda(cudaEventCreateWithFlags(&in_, cudaEventDisableTiming), "cudaEventCreate", device_);
    check_cuda(cudaEventCreateWithFlags(&out_, cudaEventDisableTiming), "cudaEventCreate", device_);
  }
  ~CudaExec() {
    set();
    cudaStreamSynchronize(stream());
    temps_.clear();
    cudaEventDestroy(in_);
    cudaEventDestroy(out_);
    cudaFreeHost(mirror_);
  }
  CudaExec(const CudaExec&) = delete;
  CudaExec& operator=(const CudaExec&) = delete;

  DLDevice dl_device() const { return {kDLCUDA, device_}; }
  static int hardware_queues() { return cuda::hardware_queues(); }
  // Ranks of one process reach each other's tensors directly (one address space, peer access).
  bool direct_allowed() const { return true; }
  // Whether a rank on another device can read `p` in place once peer access is on: memory from
  // cudaMalloc (what torch's caching allocator gives by default) can; memory mapped through CUDA's
  // virtual memory management (torch's expandable_segments) or from another stream-ordered pool
  // (torch's cudaMallocAsync backend) needs access granted by its owner, which moe-ep does not do.
  static bool peer_readable(const void* p) {
    using Get = int (*)(void*, int, unsigned long long);
    static const Get get = [] {
      void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      return lib ? reinterpret_cast<Get>(dlsym(lib, "cuPointerGetAttribute")) : nullptr;
    }();
    if (get == nullptr || p == nullptr) return true;  // cannot tell: peer access reports a fault by name
    int legacy = 1;
    constexpr int kIsLegacyCudaIpcCapable = 10;  // CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
    if (get(&legacy, kIsLegacyCudaIpcCapable, reinterpret_cast<unsigned long long>(p)) != 0) return true;
    return legacy != 0;
  }
  // Whether the caller's stream is capturing a graph (no host wait may happen then).
  bool capturing(std::uintptr_t caller) const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(caller), &status) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return status != cudaStreamCaptureStatusNone;
  }
  cudaStream_t stream() const { return stream_.get(); }
  int device() const { return device_; }

  // Symmetric memory: plain cudaMalloc (exportable through CUDA IPC).
  std::shared_ptr<void> alloc_symmetric(std::size_t bytes) {
    set();
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), fmt::format("cudaMalloc of {} bytes", bytes).c_str(), device_);
    const int dev = device_;
    return {p, [dev](void* q) {
              cudaSetDevice(dev);
              cudaFree(q);
            }};
  }
  // Stream-ordered device memory, released on the communication stream.
  std::shared_ptr<void> alloc(std::size_t bytes) {
    set();
    void* p = nullptr;
    check_cuda(cudaMallocFromPoolAsync(&p, bytes ? bytes : 1, pool_.get(), stream()),
               fmt::format("cudaMallocFromPoolAsync of {} bytes", bytes).c_str(), device_);
    const int dev = device_;
    std::shared_ptr<CUstream_st> s = stream_;
    std::shared_ptr<CUmemPoolHandle_st> pool = pool_;
    return {p, [dev, s, pool](void* q) {
              cudaSetDevice(dev);
              cudaFreeAsync(q, s.get());
            }};
  }
  void* temp(std::size_t bytes) {
    temps_.push_back(alloc(bytes));
    return temps_.back().get();
  }
  void end_op() { temps_.clear(); }  // frees are queued behind the op's work

  // An output tensor on the device; released on the communication stream behind the work the
  // caller's stream has queued when the last reference goes.
  // A 1-d ([d0]) or 2-d ([d0, d1]) tensor.
  Tensor empty(DType dtype, std::uintptr_t caller, std::int64_t d0, std::int64_t d1 = -1) {
    const std::int64_t dims[2] = {d0, d1};
    const std::span<const std::int64_t> shape(dims, d1 < 0 ? 1 : 2);
    set();
    const TensorView layout(nullptr, dtype, shape);
    const std::size_t bytes = shape.size() == 0 ? element_size(dtype) : layout.nbytes();
    void* p = nullptr;
    check_cuda(cudaMallocFromPoolAsync(&p, bytes ? bytes : 1, pool_.get(), stream()),
               fmt::format("cudaMallocFromPoolAsync of an output of {} bytes", bytes).c_str(), device_);
    struct Owner {
      DLManagedTensor managed;
      std::int64_t shape[TensorView::kMaxDims];
      std::shared_ptr<CUstream_st> stream;
      std::shared_ptr<CUmemPoolHandle_st> pool;  // outlives the executor while outputs live
      cudaStream_t caller;
      int device;
    };
    auto* o = new Owner{};
    int d = 0;
    for (std::int64_t v : shape) o->shape[d++] = v;
    o->stream = stream_;
    o->pool = pool_;
    o->caller = reinterpret_cast<cudaStream_t>(caller);
    o->device = device_;
    DLTensor& t = o->managed.dl_tensor;
    t.data = p;
    t.device = dl_device();
    t.ndim = static_cast<int>(shape.size());
    t.dtype = to_dlpack_dtype(dtype);
    t.shape = o->shape;
    t.strides = nullptr;
    t.byte_offset = 0;
    o->managed.manager_ctx = o;
    o->managed.deleter = [](DLManagedTensor* self) {
      auto* owner = static_cast<Owner*>(self->manager_ctx);
      cudaSetDevice(owner->device);
      cudaEvent_t ev;
      if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
        cudaEventRecord(ev, owner->caller);
        cudaStreamWaitEvent(owner->stream.get(), ev, 0);
        cudaEventDestroy(ev);
      }
      cudaFreeAsync(self->dl_tensor.data, owner->stream.get());
      delete owner;
    };
    return Tensor::from_dlpack(&o->managed);
  }

  template <class F>
  void each(std::int64_t n, F f) {
    // Kernel arguments above 4 KB need CUDA 12.1 (toolkit and driver; CMakeLists.txt checks the
    // toolkit) and at most 32764 bytes.
    static_assert(sizeof(F) + sizeof(std::int64_t) <= 32764, "a step's captures exceed CUDA's kernel argument limit");
    if (n <= 0) return;
    set();
    const std::int64_t blocks = std::min<std::int64_t>(core::ceil_div(n, 256), std::int64_t{sms_} * 16);
    each_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream()>>>(n, f);
    check_cuda(cudaGetLastError(), "a kernel launch", device_);
  }
  void scan(const std::int32_t* in, std::int32_t* out, std::int64_t n) {
    set();
    std::size_t bytes = 0;
    check_cuda(cub::DeviceScan::ExclusiveSum(nullptr, bytes, in, out, n, stream()), "cub::DeviceScan (size)", device_);
    check_cuda(cub::DeviceScan::ExclusiveSum(temp(bytes), bytes, in, out, n, stream()), "cub::DeviceScan", device_);
  }
  void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    set();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()), "cudaMemcpyAsync", device_);
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) {
    set();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()), "cudaMemcpyAsync (to host)", device_);
    check_cuda(cudaStreamSynchronize(stream()), "cudaStreamSynchronize", device_);
  }
  void zero(void* dst, std::size_t bytes) {
    set();
    check_cuda(cudaMemsetAsync(dst, 0, bytes, stream()), "cudaMemsetAsync", device_);
  }
  void synchronize() {
    set();
    check_cuda(cudaStreamSynchronize(stream()), "cudaStreamSynchronize", device_);
  }
  void after_caller(std::uintptr_t caller) {
    set();
    check_cuda(cudaEventRecord(in_, reinterpret_cast<cudaStream_t>(caller)), "cudaEventRecord (caller stream)", device_);
    check_cuda(cudaStreamWaitEvent(stream(), in_, 0), "cudaStreamWaitEvent", device_);
  }
  void before_caller(std::uintptr_t caller) {
    set();
    check_cuda(cudaEventRecord(out_, stream()), "cudaEventRecord", device_);
    check_cuda(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(caller), out_, 0), "cudaStreamWaitEvent (caller)",
               device_);
  }
  // fn runs on a runtime thread once the queued work completed; it must not call CUDA.
  void then(std::function<void()> fn) {
    set();
    auto* heap = new std::function<void()>(std::move(fn));
    check_cuda(cudaLaunchHostFunc(
                   stream(),
                   [](void* p) {
                     auto* f = static_cast<std::function<void()>*>(p);
                     (*f)();
                     delete f;
                   },
                   heap),
               "cudaLaunchHostFunc", device_);
  }
  // Copies a device error word to mapped host memory (when set), for take_mirrored_error.
  void mirror_error(std::uint64_t* word) {
    std::uint64_t* const host = mirror_device_;
    each(1, [=] __device__(std::int64_t) {
      const std::uint64_t w = load_acquire(word);
      if (w != 0) store_release(host, w);
    });
  }
  std::uint64_t take_mirrored_error() { return std::atomic_ref<std::uint64_t>(*mirror_).exchange(0); }
  // The host copy of the error word (for host callbacks, which must not call CUDA).
  const std::uint64_t* mirrored_error() const { return mirror_; }

  void ipc_handle(void* p, char* out) {
    set();
    cudaIpcMemHandle_t h;
    check_cuda(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle", device_);
    static_assert(sizeof h == 64);
    std::memcpy(out, &h, sizeof h);
  }
  std::shared_ptr<void> open_ipc(const char* handle) {
    set();
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle, sizeof h);
    void* p = nullptr;
    check_cuda(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle", device_);
    const int dev = device_;
    return {p, [dev](void* q) {
              cudaSetDevice(dev);
              cudaIpcCloseMemHandle(q);
            }};
  }
  void enable_peer_access_to(const void* peer) {
    set();
    cudaPointerAttributes attr{};
    check_cuda(cudaPointerGetAttributes(&attr, peer), "cudaPointerGetAttributes", device_);
    if (attr.device == device_) return;
    int can = 0;
    check_cuda(cudaDeviceCanAccessPeer(&can, device_, attr.device), "cudaDeviceCanAccessPeer", device_);
    if (!can)
      throw ResourceError(fmt::format("cuda provider: cuda:{} cannot access cuda:{} (no peer access between them)", device_,
                                      attr.device));
    const cudaError_t e = cudaDeviceEnablePeerAccess(attr.device, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else {
      check_cuda(e, "cudaDeviceEnablePeerAccess", device_);
    }
    // Peers read this rank's handle arrays, which come from its stream-ordered pool: its memory
    // is reachable from another device only when the pool grants it.
    cudaMemPool_t pool = pool_.get();
    cudaMemAccessDesc access{};
    access.location.type = cudaMemLocationTypeDevice;
    access.location.id = attr.device;
    access.flags = cudaMemAccessFlagsProtReadWrite;
    check_cuda(cudaMemPoolSetAccess(pool, &access, 1), "cudaMemPoolSetAccess", device_);
  }

 private:
  void set() const { check_cuda(cudaSetDevice(device_), "cudaSetDevice", device_); }
  static DLDataType to_dlpack_dtype(DType dtype) {
    DLManagedTensor* m = Tensor::empty({1}, dtype).to_dlpack();
    const DLDataType t = m->dl_tensor.dtype;
    m->deleter(m);
    return t;
  }

  int device_;
  int sms_ = 1;
  std::shared_ptr<CUstream_st> stream_;
  std::shared_ptr<CUmemPoolHandle_st> pool_;
  std::vector<std::shared_ptr<void>> temps_;
  std::uint64_t* mirror_ = nullptr;
  std::uint64_t* mirror_device_ = nullptr;
  cudaEvent_t in_{}, out_{};
};

static_assert(Executor<CudaExec>);

}  // namespace moe_ep::cuda
