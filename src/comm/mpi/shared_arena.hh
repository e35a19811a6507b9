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
#include <string>

namespace moe_ep::comm::mpi {

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

// Another process's arena, mapped here.
class ArenaView {
 public:
  ArenaView(pid_t pid, int fd, std::string owner);  // owner: names the peer in errors
  ~ArenaView();
  ArenaView(const ArenaView&) = delete;
  ArenaView& operator=(const ArenaView&) = delete;

  // The address of [offset, offset + bytes) of the owner's arena, mapped here. Thread-safe.
  const std::byte* at(std::size_t offset, std::size_t bytes);

 private:
  pid_t pid_;
  int owner_fd_;
  std::string owner_;
  std::mutex mutex_;
  int fd_ = -1;
  const std::byte* base_ = nullptr;
  std::size_t mapped_ = 0;
};

// Memfd-backed tensor blocks of another process (core::find_shared_block), mapped here on
// demand. A block is known by the owner's file descriptor number; since numbers are reused after
// a block is unmapped, every lookup checks the file's identity (inode) and re-maps when it
// changed. At most one mapping per descriptor number is kept. Thread-safe.
class BlockViews {
 public:
  BlockViews(pid_t pid, std::string owner) : pid_(pid), owner_(std::move(owner)) {}
  ~BlockViews();
  BlockViews(const BlockViews&) = delete;
  BlockViews& operator=(const BlockViews&) = delete;

  const std::byte* at(int fd, std::size_t offset);

 private:
  struct View {
    dev_t dev;
    ino_t ino;
    const std::byte* base;
    std::size_t bytes;
  };
  pid_t pid_;
  std::string owner_;
  std::mutex mutex_;
  std::map<int, View> views_;
};

}  // namespace moe_ep::comm::mpi
