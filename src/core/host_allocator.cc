#include "core/host_allocator.hh"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>

#include <fmt/format.h>

#include "core/arith.hh"
#include "core/log.hh"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::core {
namespace {

constexpr std::size_t kLargeThreshold = std::size_t{1} << 20;
constexpr std::size_t kLargeGranule = std::size_t{2} << 20;
constexpr std::size_t kSmallAlignment = 64;
constexpr int kMaxCandidates = 64;  // cached blocks a request compares (it takes the one freed last)

// MOE_EP_ALLOCATOR_CACHE_BYTES (its range keeps it within the address space).
std::size_t cache_limit() { return static_cast<std::size_t>(env::get(env::kAllocatorCacheBytes)); }

class LargeBlockCache {
 public:
  // A cached block is reused for a request of at least half its size, or of any size when it is
  // one granule (what a request of that size would map anyway). Of the blocks that qualify, the
  // one freed last: its lines are the likeliest to be in the caches, and a loop that allocates
  // and frees the same sizes keeps reusing the same few blocks (taking the smallest that fits
  // instead cycled a decode loop through blocks a larger shape had left, each call on cold memory).
  // need_shared: only a memfd block will do (allocate_host_shared).
  void* take(std::size_t bytes, std::size_t* block_bytes, bool need_shared = false) {
    {
      std::lock_guard lock(mutex_);
      auto best = free_.end();
      int looked = 0;  // the first kMaxCandidates blocks that qualify, by size
      for (auto it = free_.lower_bound(bytes); it != free_.end() && looked < kMaxCandidates; ++it) {
        if (it->first / 2 > bytes && it->first > kLargeGranule) break;
        if (need_shared && !shared_.contains(reinterpret_cast<std::uintptr_t>(it->second.block))) continue;
        ++looked;
        if (best == free_.end() || it->second.freed > best->second.freed) best = it;
      }
      if (best != free_.end()) {
        *block_bytes = best->first;
        void* p = best->second.block;
        stats_.cached_bytes -= best->first;
        free_.erase(best);
        return p;
      }
    }
    const std::size_t rounded = round_up(bytes, kLargeGranule);
    int fd = -1;
    if (shareable_.load(std::memory_order_relaxed)) {
      fd = memfd_create("moe-ep-tensor", MFD_CLOEXEC);
      if (fd >= 0 && ftruncate(fd, static_cast<off_t>(rounded)) != 0) {
        close(fd);
        fd = -1;
      }
      if (fd < 0)
        warn(Subsys::kAlloc, "host allocator: no shareable memfd block of {} bytes ({}): private memory instead, which "
             "node peers read through copies", rounded, std::strerror(errno));
    }
    void* p = fd >= 0 ? mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                      : mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      if (fd >= 0) close(fd);
      throw std::bad_alloc();
    }
    // No MADV_HUGEPAGE: outputs such as the low-latency slab are sparse (rows at the start of
    // each expert's block); huge pages would zero 2 MiB for every touched row.
    trace(Subsys::kAlloc, "host allocator: {} bytes mapped ({}) for {} bytes", rounded, fd >= 0 ? "memfd" : "private",
          bytes);
    struct stat st {};
    const std::uint64_t identity = fd >= 0 && fstat(fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
    std::lock_guard lock(mutex_);
    if (fd >= 0) shared_[reinterpret_cast<std::uintptr_t>(p)] = {rounded, fd, identity};
    stats_.mapped_bytes += rounded;
    ++stats_.num_maps;
    *block_bytes = rounded;
    return p;
  }

  // Runs in a deleter, which must not throw: a limit that became invalid since the allocation
  // (allocate_host reports it) keeps nothing.
  void give_back(void* p, std::size_t block_bytes) {
    std::size_t limit = 0;
    try {
      limit = cache_limit();
    } catch (const Error& e) {
      warn(Subsys::kAlloc, "host allocator: {}; a freed block of {} bytes is unmapped, not cached", e.what(),
           block_bytes);
    }
    {
      std::lock_guard lock(mutex_);
      if (stats_.cached_bytes + block_bytes <= limit) {
        free_.emplace(block_bytes, Cached{p, ++frees_});
        stats_.cached_bytes += block_bytes;
        return;
      }
      stats_.mapped_bytes -= block_bytes;
    }
    unmap(p, block_bytes);
  }

  void trim() {
    std::multimap<std::size_t, Cached> victims;
    {
      std::lock_guard lock(mutex_);
      victims.swap(free_);
      stats_.mapped_bytes -= stats_.cached_bytes;
      stats_.cached_bytes = 0;
    }
    for (auto& [bytes, cached] : victims) unmap(cached.block, bytes);
  }

  void share_new_blocks() { shareable_.store(true); }
  bool sharing() const { return shareable_.load(std::memory_order_relaxed); }

  bool find(const void* p, std::size_t bytes, SharedBlock* out) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(mutex_);
    auto it = shared_.upper_bound(at);
    if (it == shared_.begin()) return false;
    --it;
    if (at - it->first > it->second.bytes || bytes > it->second.bytes - (at - it->first)) return false;
    *out = {it->second.fd, at - it->first, it->second.identity};
    return true;
  }

  HostAllocatorStats stats() {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  struct Shared {
    std::size_t bytes;
    int fd;
    std::uint64_t identity;
  };

  void unmap(void* p, std::size_t bytes) {
    int fd = -1;
    {
      std::lock_guard lock(mutex_);
      auto it = shared_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != shared_.end()) {
        fd = it->second.fd;
        shared_.erase(it);
      }
    }
    munmap(p, bytes);
    if (fd >= 0) close(fd);
  }

  // A cached block and when it was freed (the count of frees then).
  struct Cached {
    void* block;
    std::uint64_t freed;
  };

  std::mutex mutex_;
  std::multimap<std::size_t, Cached> free_;  // by size
  std::uint64_t frees_ = 0;
  std::map<std::uintptr_t, Shared> shared_;  // memfd-backed blocks by base address (live or cached)
  std::atomic<bool> shareable_{false};
  HostAllocatorStats stats_;
};

LargeBlockCache& cache() {
  static LargeBlockCache* instance = new LargeBlockCache();  // never destroyed: outlives statics
  return *instance;
}

}  // namespace

namespace {

constexpr std::size_t kMaxBytes = std::size_t{1} << 62;  // no machine has it; rounding would overflow

// A block of the cache for `bytes` (a memfd block when need_shared), given back to it when its last
// owner lets go.
std::shared_ptr<void> cached_block(std::size_t bytes, bool need_shared) {
  cache_limit();  // a bad value is reported here, to the caller, rather than when the block comes back
  std::size_t block_bytes = 0;
  void* p = cache().take(bytes, &block_bytes, need_shared);
  return std::shared_ptr<void>(p, [block_bytes](void* q) { cache().give_back(q, block_bytes); });
}

}  // namespace

std::shared_ptr<void> allocate_host(std::size_t bytes) {
  try {
    if (bytes > kMaxBytes) throw std::bad_alloc();
    if (bytes < kLargeThreshold) {
      void* p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{kSmallAlignment});
      return std::shared_ptr<void>(p, [](void* q) { ::operator delete(q, std::align_val_t{kSmallAlignment}); });
    }
    return cached_block(bytes, false);
  } catch (const std::bad_alloc&) {
    throw ResourceError(fmt::format("allocating {} bytes of host memory failed", bytes));
  }
}

std::shared_ptr<void> allocate_host_shared(std::size_t bytes) {
  if (!cache().sharing()) return allocate_host(bytes);
  std::shared_ptr<void> block;
  try {
    if (bytes > kMaxBytes) throw std::bad_alloc();
    block = cached_block(std::max<std::size_t>(bytes, 1), true);
  } catch (const std::bad_alloc&) {
    throw ResourceError(fmt::format("allocating {} bytes of shareable host memory failed", bytes));
  }
  SharedBlock found;
  if (!cache().find(block.get(), std::max<std::size_t>(bytes, 1), &found))
    throw ResourceError(fmt::format("allocating {} bytes of shareable host memory failed: no memfd block could be "
                                    "created (file descriptors exhausted?), and node peers write this memory",
                                    bytes));
  return block;
}

void zero_host_sparse(void* p, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(p), end = begin + bytes;
  const std::uintptr_t inner_begin = round_up(begin, page), inner_end = end / page * page;
  if (bytes < kLargeThreshold || inner_end <= inner_begin) {  // operator new storage, or no whole page
    std::memset(p, 0, bytes);
    return;
  }
  std::memset(p, 0, inner_begin - begin);
  std::memset(reinterpret_cast<void*>(inner_end), 0, end - inner_end);
  auto* inner = reinterpret_cast<void*>(inner_begin);
  const std::size_t length = inner_end - inner_begin;
  SharedBlock block;
  bool zeroed = false;
  if (cache().find(inner, length, &block))
    zeroed = fallocate(block.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(block.offset),
                       static_cast<off_t>(length)) == 0;
  else
    zeroed = madvise(inner, length, MADV_DONTNEED) == 0;
  if (!zeroed) std::memset(inner, 0, length);
}

void host_allocator_trim() { cache().trim(); }

void share_new_blocks() { cache().share_new_blocks(); }

bool find_shared_block(const void* p, std::size_t bytes, SharedBlock* out) { return cache().find(p, bytes, out); }

}  // namespace moe_ep::core

namespace moe_ep {

HostAllocatorStats host_allocator_stats() { return core::cache().stats(); }

}  // namespace moe_ep
