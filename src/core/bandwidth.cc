#include "core/bandwidth.hh"

#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "core/log.hh"

namespace moe_ep::core {
namespace {

struct Mapping {
  explicit Mapping(std::size_t bytes) : bytes(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    data = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  ~Mapping() {
    if (data) munmap(data, bytes);
  }
  char* data;
  std::size_t bytes;
};

}  // namespace

double measure_copy_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions) {
  threads = std::max(threads, 1);
  repetitions = std::max(repetitions, 1);
  std::atomic<bool> failed{false};
  std::atomic<int> arrived{0};
  std::atomic<int> round{-1};
  std::vector<std::atomic<int>> finished_count(static_cast<size_t>(repetitions + 1));
  std::vector<std::thread> pool;
  std::vector<std::chrono::steady_clock::time_point> thread_end(static_cast<size_t>(threads) * (repetitions + 1));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Mapping src(bytes_per_thread), dst(bytes_per_thread);  // first touch by the copying thread
      const bool mapped = src.data && dst.data;
      if (!mapped) failed = true;
      if (mapped) std::memset(src.data, t + 1, bytes_per_thread);
      for (int r = 0; r <= repetitions; ++r) {
        ++arrived;
        while (round.load() < r) std::this_thread::yield();
        if (mapped) std::memcpy(dst.data, src.data, bytes_per_thread);
        thread_end[static_cast<size_t>(t) * (repetitions + 1) + r] = std::chrono::steady_clock::now();
        ++finished_count[static_cast<size_t>(r)];
      }
    });
  }
  double best_seconds = 1e30;
  for (int r = 0; r <= repetitions; ++r) {
    while (arrived.load() < threads * (r + 1)) std::this_thread::yield();
    const auto t0 = std::chrono::steady_clock::now();
    round.store(r);
    while (finished_count[static_cast<size_t>(r)].load() < threads) std::this_thread::yield();
    auto t1 = t0;
    for (int t = 0; t < threads; ++t) t1 = std::max(t1, thread_end[static_cast<size_t>(t) * (repetitions + 1) + r]);
    if (r > 0) best_seconds = std::min(best_seconds, std::chrono::duration<double>(t1 - t0).count());
  }
  for (auto& th : pool) th.join();
  if (failed) return 0.0;
  return static_cast<double>(bytes_per_thread) * threads / best_seconds / 1e9;
}

namespace {
std::atomic<bool> g_measured{false};
}  // namespace

const MachineBandwidth& machine_bandwidth() {
  static const MachineBandwidth measured = [] {
    const int cores = available_cores();
    const std::size_t bytes = std::size_t{64} << 20;
    MachineBandwidth m{measure_copy_bandwidth(1, bytes, 2), measure_copy_bandwidth(cores, bytes, 2), cores};
    g_measured = true;
    if (m.single_thread_gbs <= 0 || m.all_cores_gbs <= 0)
      warn(Subsys::kInit, "copy bandwidth: the measurement failed ({} GB/s on one thread, {} GB/s on {} cores): the "
           "worker-count model has no bandwidth to work with", m.single_thread_gbs, m.all_cores_gbs, cores);
    info(Subsys::kInit, "copy bandwidth: {:.1f} GB/s on one thread, {:.1f} GB/s on {} cores (the worker-count model's "
         "inputs)", m.single_thread_gbs, m.all_cores_gbs, cores);
    return m;
  }();
  return measured;
}

bool machine_bandwidth_measured() { return g_measured.load(); }

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace moe_ep::core
