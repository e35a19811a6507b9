// SharedArena: memory of one process that the processes of its host can map, for the bytes a
// rank shares with its node peers (Transport::share).
//
// Backed by an anonymous memfd: it has no name in any file system, so nothing is left behind when
// processes exit or are killed. Peers open it through /proc/<pid>/fd/<fd> of the owner and map it
// read-only. It grows (ftruncate) and never shrinks; a peer's view re-maps when the file grew.
// Offsets are stable across growth, addresses are not.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/transport.hh"

namespace moe_ep::comm {

class SharedArena {
 public:
  SharedArena();
  ~SharedArena();
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;

  int fd() const { return fd_; }
  // Ensures at least `bytes` of capacity; returns the base (valid until the next reserve()).
  std::byte* reserve(std::size_t bytes);

 private:
  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0;
};

// The process whose memory a view maps, as errors name it: this rank (the reader), the owner's
// rank and its process id (0: not visible from here). Opening the owner's memory fails with
// PeerError naming the owner when its process is gone, and with StateError (this rank and the
// rule) when it is there but cannot be opened.
struct PeerProcess {
  int reader;
  int rank;
  pid_t pid;
};

// Another process's arena, mapped here.
class ArenaView {
 public:
  ArenaView(PeerProcess owner, int fd);
  ~ArenaView();
  ArenaView(const ArenaView&) = delete;
  ArenaView& operator=(const ArenaView&) = delete;

  // The address of [offset, offset + bytes) of the owner's arena, mapped here. Thread-safe.
  const std::byte* at(std::size_t offset, std::size_t bytes);

 private:
  PeerProcess owner_;
  int owner_fd_;
  std::mutex mutex_;
  int fd_ = -1;
  const std::byte* base_ = nullptr;
  std::size_t mapped_ = 0;
};

// Memfd-backed tensor blocks of another process (core::find_shared_block), mapped here on
// demand, read-only or (windows) writable. A block is known by the owner's file descriptor
// number; since numbers are reused after a block is unmapped, every lookup checks the file's
// identity (inode) and re-maps when it changed: at() by opening the descriptor again, window() by
// the identity the owner published with it (no system call while it matches the mapping kept).
// At most one mapping per descriptor number is kept. Thread-safe.
class BlockViews {
 public:
  BlockViews(PeerProcess owner, bool writable = false) : owner_(owner), writable_(writable) {}
  ~BlockViews();
  BlockViews(const BlockViews&) = delete;
  BlockViews& operator=(const BlockViews&) = delete;

  const std::byte* at(int fd, std::size_t offset);
  // [offset, offset + bytes) of the block the owner published as (fd, identity); StateError when
  // the range leaves the block or the descriptor names another file now.
  std::byte* window(int fd, std::uint64_t identity, std::size_t offset, std::size_t bytes);

 private:
  struct View {
    dev_t dev;
    ino_t ino;
    std::byte* base;
    std::size_t bytes;
  };
  // The mapping of the file open here as `mine` (the owner's `fd`, whose stat is `st`), kept or
  // made (replacing one of another file). Called with mutex_ held.
  View& view_of(int fd, int mine, const struct stat& st);
  PeerProcess owner_;
  bool writable_;
  std::mutex mutex_;
  std::map<int, View> views_;
};

// Transport::share() for processes: a memfd tensor block (core::find_shared_block) is published
// in place, as kBlock | fd << kFdShift | offset, and mapped by peers on demand; any other bytes are
// copied into this rank's SharedArena and published as their offset + 1 (0 stays null).
//
// Transport::share_window() for processes: a span in a memfd block is published in place, with
// the block's identity, and node peers map it writable; a span peers only read that is not in one
// is copied into this rank's window staging (itself a memfd block, reused by the next
// publication); a span peers write that is not in one is refused (StateError).
class SharedSpans {
 public:
  int arena_fd() const { return arena_.fd(); }
  // The values to publish; adds the bytes it copied to `copied`.
  std::vector<const void*> share(std::span<const Transport::Span> spans, std::atomic<std::uint64_t>& copied);
  std::vector<Transport::PublishedSpan> share_window(int rank, std::span<const Transport::WindowSpan> spans,
                                                     std::atomic<std::uint64_t>& copied);

 private:
  SharedArena arena_;
  std::shared_ptr<void> staging_;  // core::allocate_host_shared
  std::size_t staging_bytes_ = 0;
};

// What one node peer shared (SharedSpans), mapped here on demand. Thread-safe.
class PeerSharedViews {
 public:
  PeerSharedViews(PeerProcess owner, int arena_fd) : owner_(owner), arena_fd_(arena_fd) {}
  const void* at(const void* published);
  // The first `bytes` bytes of a window span the owner published (share_window), writable here.
  std::byte* window(const Transport::PublishedSpan& published, std::size_t bytes);

 private:
  PeerProcess owner_;
  int arena_fd_;
  std::mutex mutex_;
  std::unique_ptr<ArenaView> arena_;
  std::unique_ptr<BlockViews> blocks_;
  std::unique_ptr<BlockViews> windows_;  // writable
};

}  // namespace moe_ep::comm
