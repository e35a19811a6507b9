// The CUDA provider's entry: a provider table (moe_ep/provider.hpp) offering the V2 generation
// (ElasticBuffer) on CUDA devices. init() says why it cannot run here (no driver, no device);
// each rank uses device (local rank % devices), so ranks share a device when there are more
// ranks than devices, each with its own stream.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "cuda/elastic_device.hh"
#include "cuda/exec_cuda.cuh"
#include "moe_ep/provider.hpp"

namespace moe_ep::cuda {
namespace {

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = fmt::format("no CUDA device (cudaGetDeviceCount: {})", cudaGetErrorString(e));
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device (cudaGetDeviceCount found none)";
  return n;
}

const char* init() {
  // Every rank's stream spins in its barriers while peers' streams run: give streams their own
  // hardware queues (8 by default), unless the user chose or the process's context already exists
  // (then the setting has no effect; buffers that need more queues than it has are refused).
  hardware_queues();
  static std::string why;
  static const int devices = device_count(&why);
  return devices > 0 ? nullptr : why.c_str();
}

provider::ElasticBackend* create_elastic(Group& group, const ElasticBufferConfig& config) {
  std::string why;
  const int n = device_count(&why);
  if (n == 0) throw StateError(fmt::format("[rank {}] ElasticBuffer (cuda provider): {}", group.rank(), why));
  return new ElasticDevice<CudaExec>(group, config, group.scaleup_rank() % n);
}

const provider::Table table{
    .abi_version = provider::kAbiVersion,
    .table_bytes = sizeof(provider::Table),
    .name = "cuda",
    .init = init,
    .create_legacy = nullptr,
    .create_elastic = create_elastic,
    .low_latency_rdma_size_hint = nullptr,
};

}  // namespace
}  // namespace moe_ep::cuda

extern "C" __attribute__((visibility("default"))) const moe_ep::provider::Table* moe_ep_provider_abi_6() {
  return &moe_ep::cuda::table;
}
