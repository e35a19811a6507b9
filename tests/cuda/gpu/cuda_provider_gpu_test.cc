// The CUDA provider on a GPU (label gpu): loaded through the provider ABI like any provider, it
// must return, on device tensors, exactly what the built-in provider returns on the same host
// inputs: every output of dispatch, cached dispatch and combine, over random cases of 1 to 8 ranks
// sharing the device(s) present (every layout, payload dtype, sync mode, weights and biases).
// Without a CUDA device the program prints "SKIP: no CUDA device" and exits 77, which CTest reports
// as skipped, not passed.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cuda/compare_case.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::testing {
namespace {

// The library built with this test, or MOE_EP_CUDA_PROVIDER (a build carried to another path).
const char* provider_path() {
  const char* given = std::getenv("MOE_EP_CUDA_PROVIDER");
  return given && *given ? given : MOE_EP_CUDA_PROVIDER_PATH;
}

const provider::Table* cuda_table() {
  static const provider::Table* table = [] {
    void* lib = dlopen(provider_path(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return static_cast<const provider::Table*>(nullptr);
    auto entry = reinterpret_cast<const provider::Table* (*)()>(dlsym(lib, provider::kEntrySymbol));
    return entry ? entry() : nullptr;
  }();
  return table;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw moe_ep::Error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

// Copies host views to the device and device results back to the host. Each rank calls on its
// own non-blocking stream: ranks sharing the legacy default stream can deadlock (docs/cuda.md,
// Streams), and a device-wide synchronization would wait for the other ranks' spinning barriers.
struct CudaMover {
  std::vector<void*> blocks;
  cudaStream_t own = nullptr;
  CudaMover() { check(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~CudaMover() {
    cudaStreamSynchronize(own);
    for (void* p : blocks) cudaFree(p);
    cudaStreamDestroy(own);
  }
  std::uintptr_t stream() const { return reinterpret_cast<std::uintptr_t>(own); }
  TensorView in(const TensorView& v) {
    const TensorView::ByteRange r = v.byte_range();
    void* p = nullptr;
    check(cudaMalloc(&p, std::max<std::int64_t>(r.end - r.begin, 1)), "cudaMalloc");
    blocks.push_back(p);
    check(cudaMemcpy(p, static_cast<const std::byte*>(v.data()) + r.begin, r.end - r.begin, cudaMemcpyHostToDevice),
          "cudaMemcpy");
    std::vector<std::int64_t> shape(v.shape().begin(), v.shape().end()), strides(v.strides().begin(), v.strides().end());
    return TensorView(static_cast<std::byte*>(p) - r.begin, v.dtype(), shape, strides).on_device({kDLCUDA, device()});
  }
  static int device() {
    int d = 0;
    cudaGetDevice(&d);
    return d;
  }
  void read_back(const TensorView& v, void* host) {
    check(cudaStreamSynchronize(own), "cudaStreamSynchronize");
    check(cudaMemcpy(host, v.data(), v.nbytes(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  Tensor host(const Tensor& t) {
    if (!t.defined()) return t;
    check(cudaStreamSynchronize(own), "cudaStreamSynchronize");
    const TensorView::ByteRange r = t.byte_range();
    Tensor storage = Tensor::empty({std::max<std::int64_t>(r.end - r.begin, 1)}, DType::kUInt8);
    check(cudaMemcpy(storage.data(), static_cast<const std::byte*>(t.data()) + r.begin, r.end - r.begin,
                     cudaMemcpyDeviceToHost),
          "cudaMemcpy");
    std::vector<std::int64_t> shape(t.shape().begin(), t.shape().end()), strides(t.strides().begin(), t.strides().end());
    return storage.with_view(TensorView(static_cast<std::byte*>(storage.data()) - r.begin, t.dtype(), shape, strides));
  }
  DispatchResult out(DispatchResult r) {
    r.recv_x = host(r.recv_x);
    r.recv_x_scales = host(r.recv_x_scales);
    r.recv_topk_idx = host(r.recv_topk_idx);
    r.recv_topk_weights = host(r.recv_topk_weights);
    auto h = std::make_shared<EPHandle>(*r.handle);
    h->topk_idx = host(h->topk_idx);
    h->psum_num_recv_tokens_per_scaleup_rank = host(h->psum_num_recv_tokens_per_scaleup_rank);
    h->psum_num_recv_tokens_per_expert = host(h->psum_num_recv_tokens_per_expert);
    h->num_unaligned_recv_tokens_per_expert = host(h->num_unaligned_recv_tokens_per_expert);
    h->recv_src_metadata = host(h->recv_src_metadata);
    h->dst_buffer_slot_idx = host(h->dst_buffer_slot_idx);
    r.handle = h;
    return r;
  }
  CombineResult out(CombineResult r) {
    r.combined_x = host(r.combined_x);
    r.combined_topk_weights = host(r.combined_topk_weights);
    return r;
  }
};

// Made on the rank's thread before its tensors: the thread's device is the one the provider
// uses for the rank (its local index modulo the devices), so CudaMover allocates there.
std::unique_ptr<provider::ElasticBackend> make_cuda(Group& group, const ElasticBufferConfig& config) {
  int devices = 1;
  check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  check(cudaSetDevice(group.scaleup_rank() % devices), "cudaSetDevice");
  return std::unique_ptr<provider::ElasticBackend>(cuda_table()->create_elastic(group, config));
}

TEST(CudaProviderOnGpu, RandomCasesMatchTheBuiltinProviderBitForBit) {
  ASSERT_NE(cuda_table(), nullptr) << "cannot load " << provider_path() << ": " << dlerror();
  expect_random_cases_match<CudaMover>(make_cuda);
}

}  // namespace
}  // namespace moe_ep::testing

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
