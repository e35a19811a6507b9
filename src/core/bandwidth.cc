#include "core/bandwidth.hh"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <thread>
#include <vector>

#include "core/cpu_features.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "core/reduce.hh"

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

#ifdef MOE_EP_X86_DISPATCH
// Reads every byte with 32-byte loads, folding them with xor (four independent chains).
__attribute__((target("avx2"))) std::uint64_t read_all_avx2(const char* p, std::size_t bytes) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  std::size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    a = _mm256_xor_si256(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_xor_si256(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_xor_si256(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_xor_si256(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i all = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), all);
  std::uint64_t folded = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  for (; i < bytes; ++i) folded ^= static_cast<unsigned char>(p[i]);
  return folded;
}
#endif

std::uint64_t read_all(const char* p, std::size_t bytes) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2()) return read_all_avx2(p, bytes);
#endif
  std::uint64_t a = 0, b = 0, c = 0, d = 0;
  std::size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    std::uint64_t w[4];
    std::memcpy(w, p + i, sizeof w);
    a ^= w[0], b ^= w[1], c ^= w[2], d ^= w[3];
  }
  std::uint64_t folded = a ^ b ^ c ^ d;
  for (; i < bytes; ++i) folded ^= static_cast<unsigned char>(p[i]);
  return folded;
}

#ifdef MOE_EP_X86_DISPATCH
// Writes every byte of `p` (32-byte aligned) with non-temporal 32-byte stores of `value`.
__attribute__((target("avx2"))) void write_all_avx2(char* p, std::size_t bytes, char value) {
  const __m256i v = _mm256_set1_epi8(value);
  std::size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + i), v);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + i + 32), v);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + i + 64), v);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + i + 96), v);
  }
  std::memset(p + i, value, bytes - i);
}
#endif

// Writes every byte once, as the data paths write their outputs (non-temporal stores where the
// CPU has them).
void write_all(char* p, std::size_t bytes, char value) {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx2()) {
    write_all_avx2(p, bytes, value);
    streaming_fence();
    return;
  }
#endif
  std::memset(p, value, bytes);
}

enum class Pass { kCopy, kStream, kRead, kWrite };

std::string_view pass_name(Pass pass) {
  switch (pass) {
    case Pass::kCopy:
      return "memcpy bandwidth probe";
    case Pass::kStream:
      return "streaming copy bandwidth probe";
    case Pass::kRead:
      return "read bandwidth probe";
    case Pass::kWrite:
      return "write bandwidth probe";
  }
  return "bandwidth probe";
}

// One measurement: `threads` threads each run the pass over their own pre-faulted buffers, all
// starting together, `repetitions` times after a warm-up. The measuring thread opens each round
// once every thread arrived and times it to the last thread's end.
class Probe {
 public:
  Probe(Pass pass, int threads, std::size_t bytes, int repetitions)
      : pass_(pass), threads_(threads), bytes_(bytes), rounds_(repetitions + 1),
        finished_(static_cast<std::size_t>(rounds_)), thread_end_(static_cast<std::size_t>(threads) * rounds_) {}

  // Bytes per second of the best repetition; 0 when a buffer could not be mapped. A thread that
  // cannot be started is a ResourceError, after the threads already started have been joined.
  double run() {
    std::vector<std::thread> pool;
    try {
      pool.reserve(static_cast<std::size_t>(threads_));
      for (int t = 0; t < threads_; ++t)
        pool.push_back(start_thread(pass_name(pass_), t, threads_, [this, t] { thread_body(t); }));
    } catch (...) {
      abandoned_ = true;  // the started threads leave their first wait
      for (auto& th : pool) th.join();
      throw;
    }
    double best_seconds = 1e30;
    for (int r = 0; r < rounds_; ++r) {
      while (arrived_.load() < threads_ * (r + 1)) std::this_thread::yield();
      const auto t0 = std::chrono::steady_clock::now();
      round_.store(r);
      while (finished_[static_cast<std::size_t>(r)].load() < threads_) std::this_thread::yield();
      auto t1 = t0;
      for (int t = 0; t < threads_; ++t) t1 = std::max(t1, end_of(t, r));
      if (r > 0) best_seconds = std::min(best_seconds, std::chrono::duration<double>(t1 - t0).count());
    }
    for (auto& th : pool) th.join();
    if (failed_) return 0.0;
    return static_cast<double>(bytes_) * threads_ / best_seconds / 1e9;
  }

 private:
  std::chrono::steady_clock::time_point& end_of(int t, int r) {
    return thread_end_[static_cast<std::size_t>(t) * rounds_ + r];
  }

  void thread_body(int t) {
    // First touch by the thread that uses them; the read pass needs no destination, the write
    // pass no source.
    Mapping src(pass_ == Pass::kWrite ? 4096 : bytes_), dst(pass_ == Pass::kRead ? 4096 : bytes_);
    const bool mapped = src.data && dst.data;
    if (!mapped) failed_ = true;
    if (mapped) std::memset(src.data, t + 1, src.bytes);
    std::uint64_t folded = 0;
    for (int r = 0; r < rounds_; ++r) {
      ++arrived_;
      while (round_.load() < r) {
        if (abandoned_.load()) return;
        std::this_thread::yield();
      }
      if (mapped) folded ^= pass_once(src.data, dst.data, r);
      end_of(t, r) = std::chrono::steady_clock::now();
      ++finished_[static_cast<std::size_t>(r)];
    }
    sink_.fetch_xor(folded, std::memory_order_relaxed);  // the reads are used
  }

  std::uint64_t pass_once(char* src, char* dst, int r) const {
    switch (pass_) {
      case Pass::kCopy:
        std::memcpy(dst, src, bytes_);
        break;
      case Pass::kStream:
        copy_bytes_streaming(dst, src, bytes_);
        streaming_fence();
        break;
      case Pass::kRead:
        return read_all(src, bytes_);
      case Pass::kWrite:
        write_all(dst, bytes_, static_cast<char>(r + 1));
        break;
    }
    return 0;
  }

  const Pass pass_;
  const int threads_;
  const std::size_t bytes_;
  const int rounds_;
  std::atomic<bool> failed_{false}, abandoned_{false};
  std::atomic<std::uint64_t> sink_{0};
  std::atomic<int> arrived_{0}, round_{-1};
  std::vector<std::atomic<int>> finished_;
  std::vector<std::chrono::steady_clock::time_point> thread_end_;
};

double measure_pass(Pass pass, int threads, std::size_t bytes_per_thread, int repetitions) {
  return Probe(pass, std::max(threads, 1), bytes_per_thread, std::max(repetitions, 1)).run();
}

}  // namespace

double measure_copy_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions) {
  return measure_pass(Pass::kCopy, threads, bytes_per_thread, repetitions);
}

double measure_streaming_copy_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions) {
  return measure_pass(Pass::kStream, threads, bytes_per_thread, repetitions);
}

double measure_read_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions) {
  return measure_pass(Pass::kRead, threads, bytes_per_thread, repetitions);
}

double measure_write_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions) {
  return measure_pass(Pass::kWrite, threads, bytes_per_thread, repetitions);
}

std::size_t probe_bytes_per_thread(std::size_t wanted, int threads, std::uint64_t available_bytes) {
  const std::uint64_t buffers = 2 * static_cast<std::uint64_t>(std::max(threads, 1));
  std::uint64_t bytes = std::min<std::uint64_t>(wanted, kProbeBudgetBytes / buffers);
  bytes = std::max<std::uint64_t>(bytes, std::min<std::uint64_t>(wanted, kProbeMinBytes));
  bytes = std::min<std::uint64_t>(bytes, available_bytes / kProbeAvailableShare / buffers);
  return static_cast<std::size_t>(std::max<std::uint64_t>(bytes / 4096 * 4096, 4096));
}

namespace {

// MemAvailable of /proc/meminfo (bytes); the free pages where it cannot be read; none known: 0.
std::uint64_t system_available_bytes() {
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f)) found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    std::fclose(f);
    if (found) return std::uint64_t{kib} * 1024;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

// The address space left under RLIMIT_AS (its limit less the process's size, /proc/self/statm),
// less `threads` stacks of the default size; no limit: the largest value.
std::uint64_t address_space_room(int threads) {
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return UINT64_MAX;
  unsigned long long pages = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%llu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  std::size_t stack = 0;
  pthread_attr_t attr;
  if (pthread_getattr_default_np(&attr) == 0) {
    pthread_attr_getstacksize(&attr, &stack);
    pthread_attr_destroy(&attr);
  }
  const std::uint64_t used = pages * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE)) +
                             static_cast<std::uint64_t>(std::max(threads, 0)) * (stack + 4096);
  return limit.rlim_cur > used ? limit.rlim_cur - used : 0;
}

std::atomic<bool> g_measured{false};

}  // namespace

std::uint64_t available_memory_bytes(int threads) {
  const std::uint64_t system = system_available_bytes();
  return std::min(system > 0 ? system : UINT64_MAX, address_space_room(threads));
}

std::size_t probe_bytes(std::size_t wanted, int threads) {
  return probe_bytes_per_thread(wanted, threads, available_memory_bytes(threads));
}

const MachineBandwidth& machine_bandwidth() {
  static const MachineBandwidth measured = [] {
    const int cores = available_cores();
    MachineBandwidth m{measure_copy_bandwidth(1, probe_bytes(kProbeWantedBytes, 1), 2),
                       measure_copy_bandwidth(cores, probe_bytes(kProbeWantedBytes, cores), 2), cores};
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
