#include "core/host_allocator.hh"

#include <sys/mman.h>

#include <map>
#include <mutex>
#include <new>

#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep::core {
namespace {

constexpr std::size_t kLargeThreshold = std::size_t{1} << 20;
constexpr std::size_t kLargeGranule = std::size_t{2} << 20;
constexpr std::size_t kSmallAlignment = 64;

class LargeBlockCache {
 public:
  void* take(std::size_t bytes, std::size_t* block_bytes) {
    {
      std::lock_guard lock(mutex_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first / 2 <= bytes) {
        *block_bytes = it->first;
        void* p = it->second;
        stats_.cached_bytes -= it->first;
        free_.erase(it);
        return p;
      }
    }
    const std::size_t rounded = (bytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    // No MADV_HUGEPAGE: outputs such as the low-latency slab are sparse (rows at the start of
    // each expert's block); huge pages would zero 2 MiB for every touched row.
    std::lock_guard lock(mutex_);
    stats_.mapped_bytes += rounded;
    ++stats_.num_maps;
    *block_bytes = rounded;
    return p;
  }

  void give_back(void* p, std::size_t block_bytes) {
    const auto limit = static_cast<std::size_t>(env::get_int("MOE_EP_ALLOCATOR_CACHE_BYTES"));
    {
      std::lock_guard lock(mutex_);
      if (stats_.cached_bytes + block_bytes <= limit) {
        free_.emplace(block_bytes, p);
        stats_.cached_bytes += block_bytes;
        return;
      }
      stats_.mapped_bytes -= block_bytes;
    }
    munmap(p, block_bytes);
  }

  void trim() {
    std::multimap<std::size_t, void*> victims;
    {
      std::lock_guard lock(mutex_);
      victims.swap(free_);
      stats_.mapped_bytes -= stats_.cached_bytes;
      stats_.cached_bytes = 0;
    }
    for (auto& [bytes, p] : victims) munmap(p, bytes);
  }

  HostAllocatorStats stats() {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  HostAllocatorStats stats_;
};

LargeBlockCache& cache() {
  static LargeBlockCache* instance = new LargeBlockCache();  // never destroyed: outlives statics
  return *instance;
}

}  // namespace

std::shared_ptr<void> allocate_host(std::size_t bytes) {
  if (bytes < kLargeThreshold) {
    void* p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{kSmallAlignment});
    return std::shared_ptr<void>(p, [](void* q) { ::operator delete(q, std::align_val_t{kSmallAlignment}); });
  }
  std::size_t block_bytes = 0;
  void* p = cache().take(bytes, &block_bytes);
  return std::shared_ptr<void>(p, [block_bytes](void* q) { cache().give_back(q, block_bytes); });
}

HostAllocatorStats host_allocator_stats() { return cache().stats(); }

void host_allocator_trim() { cache().trim(); }

}  // namespace moe_ep::core
