// Caching host allocator for tensor storage.
//
// Large blocks (>= 1 MiB) come from anonymous mmap, rounded up to 2 MiB, and are kept in a
// free list after release instead of being unmapped: the next allocation of a similar size
// reuses pages that are already faulted in, so a steady-state dispatch/combine loop does not pay
// page faults for its outputs. A block is reused for a request of at least half its size; of the
// blocks that fit, the one freed last (the likeliest still in the caches).
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
#include <cstdint>
#include <memory>

#include "moe_ep/tensor.hpp"  // HostAllocatorStats, host_allocator_stats()

namespace moe_ep::core {

// Returns storage of at least `bytes` bytes, 64-byte aligned, released by the deleter.
std::shared_ptr<void> allocate_host(std::size_t bytes);
// Sets [p, p + bytes) of storage from allocate_host to zero. For a large block the whole pages
// inside the range are handed back to the kernel (madvise MADV_DONTNEED, or a hole punched in a
// shareable block's memfd), which maps zero pages again on first touch: a mostly untouched output
// (the swizzled NVFP4 scales) costs page faults for the pages written, not a memset of all of it.
void zero_host_sparse(void* p, std::size_t bytes);
// Unmaps every cached free block.
void host_allocator_trim();

// From now on, large blocks are memfd-backed (see above). Process-wide, cannot be undone.
void share_new_blocks();

// Storage node peers can map and write (a memfd block, whatever the size) once share_new_blocks()
// was called; before that, allocate_host's. Small requests take a whole 2 MiB block (only the
// pages used become resident; freed blocks are cached and reused). ResourceError when no memfd
// block can be had (no file descriptors left): callers that publish it as a window need one.
std::shared_ptr<void> allocate_host_shared(std::size_t bytes);

// The memfd block holding [p, p + bytes), if any: its file descriptor (open while the block is
// mapped, live or cached), the offset of p in it, and the block file's identity (its inode), by
// which a peer that mapped the descriptor number before knows whether it still names this file.
struct SharedBlock {
  int fd = -1;
  std::size_t offset = 0;
  std::uint64_t identity = 0;
};
bool find_shared_block(const void* p, std::size_t bytes, SharedBlock* out);

}  // namespace moe_ep::core
