// HostExec: the CUDA provider's executor on host threads, so that ElasticDevice's whole algorithm
// (routing, scans, barriers over symmetric memory, row pulls, reductions) runs and is compared
// with the built-in provider on machines without a GPU; "device" memory is host memory.
//
// Guarantees, as a kernel launch gives them on one stream:
//  - each(n, f) runs f(i) exactly once for every i in [0, n) and returns when all have run: the
//    writes of one step happen before everything after it on the rank (the next steps, copies,
//    the host), whichever thread made them. Within a step nothing is ordered.
//  - And nothing is ordered on purpose: the index space is cut into up to kChunks chunks, their
//    order shuffled and each chunk walked in a scrambled order (a random stride), and the chunks
//    dealt round-robin to kThreads threads (the caller and the executor's workers) that run at
//    once (a step of one index runs on the caller). A step that depends on index order, or
//    reads what another index of the same step writes, gives wrong results here as on a GPU.
//    The order is drawn from a generator seeded by MOE_EP_HOST_EXEC_SEED (default kDefaultSeed)
//    and the executor's creation number, and differs from call to call; the seed is printed
//    once per process. Steps must not depend on the thread they run on, and an index may spin
//    on other ranks (a barrier) but never on another index of its own step. An exception a step
//    throws is rethrown by each() after every index ran.
//  - scan is sequential (on GPU: CUB's exact device-wide scan); copies run on the caller.
//  - With staging, ranks behave as processes do: every tensor peers read is first copied into the
//    rank's symmetric region, which is real shared memory (a memfd mapped MAP_SHARED); its IPC
//    handle is the descriptor and size, and open_ipc maps the same pages again at another
//    address, as CUDA IPC does, so peers reach the region only through their own mapping.
//    Device atomics (std::atomic_ref) work across the mappings: they are the same pages.
//  Without staging ranks read each other's tensors in place (ranks as threads of one process).
// Under ThreadSanitizer the hand-over between steps is a semaphore (a happens-before edge), so a
// correct algorithm runs clean; TSan watches addresses, so it sees races between ranks on the
// in-place path, not through the second mappings of the staged one.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <semaphore>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/executor.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::cuda::testing {

class HostExec {
 public:
  static constexpr int kThreads = 4;  // the caller and kThreads - 1 workers
  static constexpr std::int64_t kChunks = 256;
  static constexpr std::uint64_t kDefaultSeed = 0x5eed;

  explicit HostExec(int device)
      : device_(device), rng_(seed() ^ (0x9e3779b97f4a7c15ull * next_instance().fetch_add(1))) {
    for (int w = 0; w + 1 < kThreads; ++w) workers_.emplace_back([this, w] { work(w + 1); });
  }
  ~HostExec() {
    stop_ = true;
    for (Gate& g : start_) g.open.release();
    for (std::thread& t : workers_) t.join();
  }
  HostExec(const HostExec&) = delete;
  HostExec& operator=(const HostExec&) = delete;

  // The seed of every executor's orders: MOE_EP_HOST_EXEC_SEED (decimal or 0x hex), else kDefaultSeed.
  static std::uint64_t seed() {
    static const std::uint64_t s = [] {
      const char* v = std::getenv("MOE_EP_HOST_EXEC_SEED");
      const std::uint64_t r = v && *v ? std::strtoull(v, nullptr, 0) : kDefaultSeed;
      std::fprintf(stderr, "HostExec: device steps on %d threads in a random order, MOE_EP_HOST_EXEC_SEED=%llu\n",
                   kThreads, static_cast<unsigned long long>(r));
      return r;
    }();
    return s;
  }

  // With staging, ranks behave as processes do (see above).
  static inline std::atomic<bool> staging{false};
  bool direct_allowed() const { return !staging.load(); }

  // Views of host memory labelled as memory of CUDA device `device` (only the label differs),
  // so the provider's device checks run as on a GPU.
  DLDevice dl_device() const { return {kDLCUDA, device_}; }

  std::shared_ptr<void> alloc(std::size_t bytes) {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) throw ResourceError("HostExec: out of memory");
    return {p, [](void* q) { std::free(q); }};
  }
  // Shared memory (a memfd) mapped here; ipc_handle names it for open_ipc.
  std::shared_ptr<void> alloc_symmetric(std::size_t bytes) {
    bytes = std::max<std::size_t>(bytes, 1);
    const int fd = ::memfd_create("moe_ep_host_exec", MFD_CLOEXEC);
    if (fd < 0) throw ResourceError(std::string("HostExec: memfd_create: ") + std::strerror(errno));
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      ::close(fd);
      throw ResourceError(std::string("HostExec: ftruncate of the symmetric region: ") + std::strerror(e));
    }
    void* p = map_shared(fd, bytes);
    regions_.push_back({p, fd, bytes});
    return {p, [fd, bytes](void* q) {
              ::munmap(q, bytes);
              ::close(fd);
            }};
  }
  void* temp(std::size_t bytes) {
    temps_.push_back(alloc(bytes));
    return temps_.back().get();
  }
  void end_op() { temps_.clear(); }

  // A 1-d ([d0]) or 2-d ([d0, d1]) tensor.
  Tensor empty(DType dtype, std::uintptr_t /*stream*/, std::int64_t d0, std::int64_t d1 = -1) {
    const std::int64_t dims[2] = {d0, d1};
    const std::span<const std::int64_t> shape(dims, d1 < 0 ? 1 : 2);
    Tensor host = Tensor::empty(shape, dtype);
    std::memset(host.data(), 0xA5, host.nbytes());  // uninitialised memory is not zero on a GPU either
    DLManagedTensor* m = host.to_dlpack();
    m->dl_tensor.device = dl_device();
    return Tensor::from_dlpack(m);
  }

  template <class F>
  void each(std::int64_t n, F f) {
    if (n <= 0) return;
    if (n == 1) {
      f(std::int64_t{0});
      return;
    }
    plan(n);
    job_ = [](void* fn, std::int64_t i) { (*static_cast<F*>(fn))(i); };
    fn_ = &f;
    const int helpers = static_cast<int>(std::min<std::size_t>(kThreads, chunks_.size())) - 1;
    helpers_ = helpers;
    for (int w = 0; w < helpers; ++w) start_[w].open.release();
    run_share(0);
    for (int w = 0; w < helpers; ++w) done_.acquire();
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  void scan(const std::int32_t* in, std::int32_t* out, std::int64_t n) {
    std::int32_t run = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int32_t v = in[i];
      out[i] = run;
      run += v;
    }
  }
  void copy(void* dst, const void* src, std::size_t bytes) { std::memmove(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  void zero(void* dst, std::size_t bytes) { std::memset(dst, 0, bytes); }
  void synchronize() {}
  // Test knobs for what only a GPU has: the hardware queues each device gives the process (0: no
  // limit), and pointers ranks on other devices cannot read in place (peer_readable).
  static inline std::atomic<int> queues{0};
  static int hardware_queues() { return queues.load(); }
  static inline std::atomic<const void*> unreadable{nullptr};
  static bool peer_readable(const void* p) { return p == nullptr || p != unreadable.load(); }
  // Runs at after_caller (tests observe when a call orders itself after its caller's stream).
  static inline std::function<void(int device)> on_after_caller;
  void after_caller(std::uintptr_t) {
    if (on_after_caller) on_after_caller(device_);
  }
  void before_caller(std::uintptr_t) {}
  void then(const std::function<void()>& fn) { fn(); }

  void mirror_error(std::uint64_t* word) {
    const std::uint64_t w = std::atomic_ref<std::uint64_t>(*word).load();
    if (w != 0) std::atomic_ref<std::uint64_t>(mirrored_).store(w);
  }
  std::uint64_t take_mirrored_error() { return std::atomic_ref<std::uint64_t>(mirrored_).exchange(0); }
  const std::uint64_t* mirrored_error() const { return &mirrored_; }

  // The handle of a region of alloc_symmetric: its descriptor and size.
  void ipc_handle(void* p, char* out) {
    for (const Region& r : regions_) {
      if (r.base != p) continue;
      const std::int64_t words[2] = {r.fd, static_cast<std::int64_t>(r.bytes)};
      std::memcpy(out, words, sizeof words);
      return;
    }
    throw ResourceError("HostExec: ipc_handle of memory that alloc_symmetric did not return");
  }
  // The region again, through a descriptor of its own and at an address of its own.
  std::shared_ptr<void> open_ipc(const char* handle) {
    std::int64_t words[2];
    std::memcpy(words, handle, sizeof words);
    const std::string path = "/proc/self/fd/" + std::to_string(words[0]);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) throw ResourceError("HostExec: open " + path + ": " + std::strerror(errno));
    const auto bytes = static_cast<std::size_t>(words[1]);
    void* p = nullptr;
    try {
      p = map_shared(fd, bytes);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);  // the mapping keeps the pages
    return {p, [bytes](void* q) { ::munmap(q, bytes); }};
  }
  void enable_peer_access_to(const void*) {}

 private:
  struct Region {
    void* base;
    int fd;
    std::size_t bytes;
  };
  // Indices [begin, begin + len), walked from `first` by `stride` (coprime with len) modulo len.
  struct Chunk {
    std::int64_t begin, len, first, stride;
  };

  static std::atomic<std::uint64_t>& next_instance() {
    static std::atomic<std::uint64_t> n{0};
    return n;
  }
  static void* map_shared(int fd, std::size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      throw ResourceError(std::string("HostExec: mmap of the symmetric region: ") + std::strerror(errno));
    return p;
  }

  // This call's chunks, in a fresh random order, each with its own walk.
  void plan(std::int64_t n) {
    const std::int64_t count = std::min(n, kChunks), size = (n + count - 1) / count;
    chunks_.clear();
    for (std::int64_t b = 0; b < n; b += size) {
      const std::int64_t len = std::min(size, n - b);
      std::int64_t stride = 1 + static_cast<std::int64_t>(rng_() % static_cast<std::uint64_t>(len));
      while (std::gcd(stride, len) != 1) --stride;
      chunks_.push_back({b, len, static_cast<std::int64_t>(rng_() % static_cast<std::uint64_t>(len)), stride});
    }
    std::shuffle(chunks_.begin(), chunks_.end(), rng_);
  }
  // Thread `who` (0: the caller) runs chunks who, who + participants, ...
  void run_share(int who) {
    const std::size_t participants = static_cast<std::size_t>(helpers_) + 1;
    for (std::size_t c = static_cast<std::size_t>(who); c < chunks_.size(); c += participants) {
      const Chunk k = chunks_[c];
      for (std::int64_t j = 0, at = k.first; j < k.len; ++j, at = (at + k.stride) % k.len) {
        try {
          job_(fn_, k.begin + at);
        } catch (...) {
          const std::lock_guard<std::mutex> lock(error_mu_);
          if (!error_) error_ = std::current_exception();
        }
      }
    }
  }
  void work(int who) {
    for (;;) {
      start_[who - 1].open.acquire();
      if (stop_) return;
      run_share(who);
      done_.release();
    }
  }

  int device_;
  std::mt19937_64 rng_;
  std::vector<Chunk> chunks_;
  void (*job_)(void*, std::int64_t) = nullptr;
  void* fn_ = nullptr;
  int helpers_ = 0;
  struct Gate {
    std::binary_semaphore open{0};
  };
  Gate start_[kThreads - 1];  // one per worker: its share of the current step is ready
  std::counting_semaphore<kThreads> done_{0};
  std::atomic<bool> stop_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
  std::vector<Region> regions_;
  std::vector<std::shared_ptr<void>> temps_;
  std::uint64_t mirrored_ = 0;
};

static_assert(Executor<HostExec>);

}  // namespace moe_ep::cuda::testing
