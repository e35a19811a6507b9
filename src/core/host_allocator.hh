// Caching host allocator for tensor storage.
//
// Large blocks (>= 1 MiB) come from anonymous mmap, rounded up to 2 MiB, and are kept in a
// best-fit free list after release instead of being unmapped: the next allocation of a similar
// size reuses pages that are already faulted in, so a steady-state dispatch/combine loop does not
// pay page faults for its outputs. A block is reused for a request of at least half its size.
// The cache is bounded (MOE_EP_ALLOCATOR_CACHE_BYTES, default 64 GiB of address space; only the
// pages a block's users touched are resident); beyond it, blocks are unmapped on release. Small blocks use aligned operator new. Thread-safe.
//
// Shareable blocks: once share_new_blocks() was called (the MPI transport does, for processes
// whose node peers read this process's tensors), new large blocks are memfd-backed shared
// mappings, so a transport can let node peers map a tensor instead of copying it
// (find_shared_block). If a memfd cannot be created (no file descriptors left), the block is an
// ordinary private mapping and callers copy.
#pragma once

#include <cstddef>
#include <memory>

namespace moe_ep::core {

struct HostAllocatorStats {
  std::size_t mapped_bytes = 0;   // currently mapped by the large-block path (live + cached)
  std::size_t cached_bytes = 0;   // mapped but free, ready for reuse
  std::size_t num_maps = 0;       // mmap calls since start (a steady-state loop keeps this flat)
};

// Returns storage of at least `bytes` bytes, 64-byte aligned, released by the deleter.
std::shared_ptr<void> allocate_host(std::size_t bytes);
HostAllocatorStats host_allocator_stats();
// Sets [p, p + bytes) of storage from allocate_host to zero. For a large block the whole pages
// inside the range are handed back to the kernel (madvise MADV_DONTNEED, or a hole punched in a
// shareable block's memfd), which maps zero pages again on first touch: a mostly untouched output
// (the swizzled NVFP4 scales) costs page faults for the pages written, not a memset of all of it.
void zero_host_sparse(void* p, std::size_t bytes);
// Unmaps every cached free block.
void host_allocator_trim();

// From now on, large blocks are memfd-backed (see above). Process-wide, cannot be undone.
void share_new_blocks();

// The memfd block holding [p, p + bytes), if any: its file descriptor (open while the block is
// mapped, live or cached) and the offset of p in it.
struct SharedBlock {
  int fd = -1;
  std::size_t offset = 0;
};
bool find_shared_block(const void* p, std::size_t bytes, SharedBlock* out);

}  // namespace moe_ep::core
