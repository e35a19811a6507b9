// The CUDA provider's bench (bench_entry.hh; `moe-ep bench --provider cuda`, docs/cuda.md): by
// default the DeepSeek-V3 shape (hidden 7168, top-8 of 256 experts, BF16) at 4096 and 128 tokens
// per rank, 8 ranks as threads on the device(s) present. Prints dispatch and combine logical
// bandwidth (rows every rank receives, times the row bytes, per second of the slowest rank)
// beside the device-to-device copy bandwidth measured in the same run (cudaMemcpy of 2 GiB:
// bytes copied per second), their ratio, and the times in µs (the decode latency).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "cuda/bench_entry.hh"
#include "moe_ep/group.hpp"
#include "moe_ep/provider.hpp"

extern "C" const moe_ep::provider::Table* moe_ep_provider_abi_6();

namespace {

using Clock = std::chrono::steady_clock;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

double copy_bandwidth() {
  const std::size_t bytes = std::size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, bytes), "cudaMalloc");
  check(cudaMalloc(&b, bytes), "cudaMalloc");
  check(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
  check(cudaDeviceSynchronize(), "sync");
  const auto t0 = Clock::now();
  for (int i = 0; i < 5; ++i) check(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
  check(cudaDeviceSynchronize(), "sync");
  const double s = std::chrono::duration<double>(Clock::now() - t0).count() / 5;
  cudaFree(a);
  cudaFree(b);
  return static_cast<double>(bytes) / s / 1e9;
}

struct Timing {
  double dispatch_s = 0, combine_s = 0;
  std::int64_t bytes = 0;  // rows received by every rank, times the row size
};

Timing run(const moe_ep::provider::Table* table, const MoeEpCudaBenchOptions& o, int tokens, int iters) {
  const int ranks = o.ranks, H = o.hidden, k = o.topk, E = o.experts;
  Timing timing;
  std::atomic<std::int64_t> bytes{0};
  std::vector<double> dispatch(ranks), combine(ranks);
  moe_ep::LocalWorld world(ranks);
  world.run([&](moe_ep::Group& group) {
    const int rank = group.rank();
    int devices = 1;
    cudaGetDeviceCount(&devices);
    check(cudaSetDevice(rank % devices), "cudaSetDevice");
    moe_ep::ElasticBufferConfig config;
    config.num_max_tokens_per_rank = tokens;
    config.hidden = H;
    config.num_topk = k;
    std::unique_ptr<moe_ep::provider::ElasticBackend> buffer(table->create_elastic(group, config));
    std::mt19937_64 rng(o.seed * 7919 + static_cast<unsigned>(rank));
    std::vector<std::int64_t> topk(static_cast<size_t>(tokens) * k);
    std::vector<int> experts(E);
    for (int e = 0; e < E; ++e) experts[e] = e;
    for (int t = 0; t < tokens; ++t) {
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int j = 0; j < k; ++j) topk[static_cast<size_t>(t) * k + j] = experts[j];
    }
    void *x = nullptr, *ids = nullptr;
    check(cudaMalloc(&x, static_cast<std::size_t>(tokens) * H * 2), "cudaMalloc");
    check(cudaMemset(x, 0x3f, static_cast<std::size_t>(tokens) * H * 2), "cudaMemset");
    check(cudaMalloc(&ids, topk.size() * 8), "cudaMalloc");
    check(cudaMemcpy(ids, topk.data(), topk.size() * 8, cudaMemcpyHostToDevice), "cudaMemcpy");
    const DLDevice dev{kDLCUDA, rank % devices};
    // The rank's own stream: ranks must not share the legacy default stream (docs/cuda.md, Streams).
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    moe_ep::DispatchArgs args;
    args.stream = reinterpret_cast<std::uintptr_t>(stream);
    args.x = moe_ep::TensorView(x, moe_ep::DType::kBF16, {tokens, H}).on_device(dev);
    args.topk_idx = moe_ep::TensorView(ids, moe_ep::DType::kInt64, {tokens, k}).on_device(dev);
    args.num_experts = E;
    double d_total = 0, c_total = 0;
    for (int i = 0; i < iters + 2; ++i) {
      group.barrier();
      const auto t0 = Clock::now();
      moe_ep::DispatchResult r = buffer->dispatch(args);
      check(cudaStreamSynchronize(stream), "sync");
      group.barrier();
      const auto t1 = Clock::now();
      moe_ep::CombineArgs c;
      c.x = r.recv_x;
      c.handle = r.handle;
      c.stream = args.stream;
      moe_ep::CombineResult out = buffer->combine(c);
      check(cudaStreamSynchronize(stream), "sync");
      group.barrier();
      const auto t2 = Clock::now();
      if (i >= 2) {
        d_total += std::chrono::duration<double>(t1 - t0).count();
        c_total += std::chrono::duration<double>(t2 - t1).count();
      }
      if (i == 0) bytes += r.handle->num_recv_tokens * H * 2;
    }
    dispatch[rank] = d_total / iters;
    combine[rank] = c_total / iters;
    buffer->destroy();
    cudaFree(x);
    cudaFree(ids);
    cudaStreamDestroy(stream);
  });
  timing.dispatch_s = *std::max_element(dispatch.begin(), dispatch.end());
  timing.combine_s = *std::max_element(combine.begin(), combine.end());
  timing.bytes = bytes;
  return timing;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int moe_ep_cuda_bench_1(const MoeEpCudaBenchOptions* options) {
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::printf("SKIP: no CUDA device\n");
      return 77;
    }
    const MoeEpCudaBenchOptions& o = *options;
    const moe_ep::provider::Table* table = moe_ep_provider_abi_6();
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    const double copy = copy_bandwidth();
    std::printf("device: %s (%d present); %d ranks; hidden %d, top-%d of %d experts, BF16\n", prop.name, devices, o.ranks,
                o.hidden, o.topk, o.experts);
    std::printf("baseline: cudaMemcpy device to device, 2 GiB, bytes copied / s: %.1f GB/s\n", copy);
    std::printf("formula: logical GB/s = rows received by all ranks x hidden x 2 B / time of the slowest rank "
                "(mean over the timed iterations); ratio = logical / baseline\n");
    for (const auto& [tokens, iters] : {std::pair{o.prefill_tokens, o.prefill_iterations},
                                        std::pair{o.decode_tokens, o.decode_iterations}}) {
      const Timing t = run(table, o, tokens, iters);
      const double d = static_cast<double>(t.bytes) / t.dispatch_s / 1e9;
      const double c = static_cast<double>(t.bytes) / t.combine_s / 1e9;
      std::printf("tokens/rank %5d: dispatch %9.1f us %7.1f GB/s (%.2f of copy) | combine %9.1f us %7.1f GB/s "
                  "(%.2f of copy)\n",
                  tokens, t.dispatch_s * 1e6, d, d / copy, t.combine_s * 1e6, c, c / copy);
    }
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe-ep bench --provider cuda: %s\n", e.what());
    return 1;
  }
}
