#include "comm/shared_arena.hh"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "comm/control_page.hh"
#include "core/arith.hh"
#include "core/host_allocator.hh"
#include "core/log.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::comm {
namespace {

// "[rank R] memory of rank P": how errors start.
std::string memory_of(const PeerProcess& owner) { return fmt::format("[rank {}] memory of rank {}", owner.reader, owner.rank); }

// Opens the owner's descriptor through /proc, read-only. A process that is gone has left the
// group (PeerError naming it); one that is there but cannot be opened breaks the rule that the
// processes of one node can open each other's descriptors.
int open_peer_fd(const PeerProcess& owner, int fd, int flags = O_RDONLY) {
  if (owner.pid <= 0)
    throw StateError(fmt::format("{} cannot be mapped: its process is not visible from this one (another pid "
                                 "namespace); the ranks of one node must run in one pid namespace",
                                 memory_of(owner)));
  const std::string path = fmt::format("/proc/{}/fd/{}", owner.pid, fd);
  const int mine = open(path.c_str(), flags | O_CLOEXEC);
  if (mine >= 0) return mine;
  const int error = errno;
  if (process_gone(owner.pid))
    throw PeerError(fmt::format("[rank {}] rank {} left the group: its process {} on this host is gone (found mapping "
                                "the memory it shared)",
                                owner.reader, owner.rank, owner.pid),
                    {owner.rank});
  throw StateError(fmt::format("{}: cannot open {}: {} (processes of one node must be able to open each other's "
                               "/proc/<pid>/fd entries)",
                               memory_of(owner), path, std::strerror(error)));
}

constexpr std::size_t kGrain = std::size_t{2} << 20;

std::string errno_text() { return std::strerror(errno); }

}  // namespace

SharedArena::SharedArena() {
  fd_ = memfd_create("moe-ep-shared", MFD_CLOEXEC);
  if (fd_ < 0) throw StateError(fmt::format("shared arena: memfd_create failed: {}", errno_text()));
}

SharedArena::~SharedArena() {
  if (base_) munmap(base_, capacity_);
  if (fd_ >= 0) close(fd_);
}

std::byte* SharedArena::reserve(std::size_t bytes) {
  if (bytes <= capacity_) return base_;
  const std::size_t grown = std::max(bytes, capacity_ + capacity_ / 2);
  const std::size_t capacity = core::round_up(grown, kGrain);
  if (ftruncate(fd_, static_cast<off_t>(capacity)) != 0)
    throw StateError(fmt::format("shared arena: growing to {} bytes failed: {}", capacity, errno_text()));
  void* p = base_ ? mremap(base_, capacity_, capacity, MREMAP_MAYMOVE)
                  : mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) throw StateError(fmt::format("shared arena: mapping {} bytes failed: {}", capacity, errno_text()));
  base_ = static_cast<std::byte*>(p);
  capacity_ = capacity;
  return base_;
}

ArenaView::ArenaView(PeerProcess owner, int fd) : owner_(owner), owner_fd_(fd) {}

ArenaView::~ArenaView() {
  if (base_) munmap(const_cast<std::byte*>(base_), mapped_);
  if (fd_ >= 0) close(fd_);
}

const std::byte* ArenaView::at(std::size_t offset, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  if (fd_ < 0) fd_ = open_peer_fd(owner_, owner_fd_);
  bytes = std::max<std::size_t>(bytes, 1);
  if (offset > SIZE_MAX - bytes) throw StateError(fmt::format("{}: shared arena: bad range", memory_of(owner_)));
  // The owner grows the file before it publishes offsets into the new part: map all of it.
  struct stat st {};
  if (fstat(fd_, &st) != 0) throw StateError(fmt::format("{}: shared arena: fstat failed: {}", memory_of(owner_), errno_text()));
  const auto size = static_cast<std::size_t>(st.st_size);
  if (offset + bytes > size)
    throw StateError(fmt::format("{}: shared arena: bytes [{}, {}) published beyond its {} bytes", memory_of(owner_), offset,
                                 offset + bytes, size));
  if (base_ == nullptr || size > mapped_) {
    if (base_) munmap(const_cast<std::byte*>(base_), mapped_);
    base_ = nullptr;
    mapped_ = 0;
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) throw StateError(fmt::format("{}: shared arena: mapping failed: {}", memory_of(owner_), errno_text()));
    base_ = static_cast<const std::byte*>(p);
    mapped_ = size;
  }
  return base_ + offset;
}

BlockViews::~BlockViews() {
  for (auto& [fd, v] : views_) munmap(v.base, v.bytes);
}

BlockViews::View& BlockViews::view_of(int fd, int mine, const struct stat& st) {
  auto it = views_.find(fd);
  if (it != views_.end() && (it->second.dev != st.st_dev || it->second.ino != st.st_ino)) {
    munmap(it->second.base, it->second.bytes);  // the number names another block now
    views_.erase(it);
    it = views_.end();
  }
  if (it == views_.end()) {
    const auto bytes = static_cast<std::size_t>(st.st_size);
    const int prot = writable_ ? PROT_READ | PROT_WRITE : PROT_READ;
    void* p = bytes ? mmap(nullptr, bytes, prot, MAP_SHARED, mine, 0) : MAP_FAILED;
    if (p == MAP_FAILED)
      throw StateError(fmt::format("{}: shared tensor: mapping {} bytes failed: {}", memory_of(owner_), bytes, errno_text()));
    it = views_.emplace(fd, View{st.st_dev, st.st_ino, static_cast<std::byte*>(p), bytes}).first;
  }
  return it->second;
}

// Opens the owner's descriptor `fd` and runs fn(mine, stat) with it open.
template <class Fn>
decltype(auto) with_peer_fd(const PeerProcess& owner, int fd, int flags, Fn fn) {
  const int mine = open_peer_fd(owner, fd, flags);
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{mine};
  struct stat st {};
  if (fstat(mine, &st) != 0)
    throw StateError(fmt::format("{}: shared tensor: fstat failed: {}", memory_of(owner), errno_text()));
  return fn(mine, st);
}

const std::byte* BlockViews::at(int fd, std::size_t offset) {
  const View v = with_peer_fd(owner_, fd, writable_ ? O_RDWR : O_RDONLY, [&](int mine, const struct stat& st) -> View {
    std::lock_guard lock(mutex_);
    return view_of(fd, mine, st);
  });
  if (offset >= v.bytes)
    throw StateError(fmt::format("{}: shared tensor: offset {} beyond its {}-byte block", memory_of(owner_), offset, v.bytes));
  return v.base + offset;
}

std::byte* BlockViews::window(int fd, std::uint64_t identity, std::size_t offset, std::size_t bytes) {
  std::unique_lock lock(mutex_);
  auto it = views_.find(fd);
  View* v = it != views_.end() && static_cast<std::uint64_t>(it->second.ino) == identity ? &it->second : nullptr;
  if (v == nullptr) {
    lock.unlock();
    v = &with_peer_fd(owner_, fd, writable_ ? O_RDWR : O_RDONLY, [&](int mine, const struct stat& st) -> View& {
      if (static_cast<std::uint64_t>(st.st_ino) != identity)
        throw StateError(fmt::format("{}: window: its descriptor {} names another file than the one it published "
                                     "(a stale publication)", memory_of(owner_), fd));
      lock.lock();
      return view_of(fd, mine, st);
    });
  }
  if (offset > v->bytes || bytes > v->bytes - offset)
    throw StateError(fmt::format("{}: window: bytes [{}, {}) leave its {}-byte block", memory_of(owner_), offset,
                                 offset + bytes, v->bytes));
  return v->base + offset;
}

namespace {
constexpr std::uint64_t kBlock = std::uint64_t{1} << 63;
constexpr int kFdShift = 44;
constexpr std::uint64_t kOffsetMask = (std::uint64_t{1} << kFdShift) - 1;

// A span in a memfd block, as published: kBlock | fd << kFdShift | offset (0 when it does not
// fit, which no descriptor number or block offset of a live process reaches).
std::uint64_t block_value(const core::SharedBlock& b) {
  if (b.offset > kOffsetMask || static_cast<std::uint64_t>(b.fd) >= (std::uint64_t{1} << (63 - kFdShift))) return 0;
  return kBlock | static_cast<std::uint64_t>(b.fd) << kFdShift | b.offset;
}

// Bytes a copied span takes in a staging block: copies start 64-byte aligned.
std::size_t slot_bytes(std::size_t bytes) { return core::round_up(bytes, std::size_t{64}); }
}  // namespace

std::vector<const void*> SharedSpans::share(std::span<const Transport::Span> spans, std::atomic<std::uint64_t>& copied) {
  std::vector<const void*> published(spans.size(), nullptr);
  std::vector<core::SharedBlock> blocks(spans.size());
  std::size_t total = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const Transport::Span& s = spans[i];
    if (s.bytes == 0) continue;
    core::SharedBlock& b = blocks[i];
    if (core::find_shared_block(s.data, s.bytes, &b) && block_value(b) != 0) {
      published[i] = reinterpret_cast<const void*>(static_cast<std::uintptr_t>(block_value(b)));
      continue;
    }
    b.fd = -1;
    total += slot_bytes(s.bytes);
  }
  if (total == 0) {
    core::trace(core::Subsys::kP2P, "share: {} span(s) published as memfd blocks", spans.size());
    return published;
  }
  std::byte* base = arena_.reserve(total);
  std::size_t at = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].bytes == 0 || blocks[i].fd >= 0) continue;
    std::memcpy(base + at, spans[i].data, spans[i].bytes);
    published[i] = reinterpret_cast<const void*>(static_cast<std::uintptr_t>(at + 1));
    at += slot_bytes(spans[i].bytes);
  }
  copied.fetch_add(at, std::memory_order_relaxed);
  core::trace(core::Subsys::kP2P, "share: {} bytes copied into the shared arena (tensors not in memfd blocks)", at);
  return published;
}

std::vector<Transport::PublishedSpan> SharedSpans::share_window(int rank, std::span<const Transport::WindowSpan> spans,
                                                                std::atomic<std::uint64_t>& copied) {
  std::vector<Transport::PublishedSpan> published(spans.size());
  std::vector<std::size_t> staged;  // spans peers read, copied into the staging block
  std::size_t total = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const Transport::WindowSpan& s = spans[i];
    if (s.bytes == 0) continue;
    core::SharedBlock b;
    if (core::find_shared_block(s.data, s.bytes, &b) && block_value(b) != 0) {
      published[i] = {.value = block_value(b), .identity = b.identity, .bytes = s.bytes};
    } else if (s.peers_write) {
      throw StateError(fmt::format("[rank {}] share_window: span {} ({} bytes) is written by node peers but is not in "
                                   "memory they can map (allocate it with core::allocate_host_shared)",
                                   rank, i, s.bytes));
    } else {
      staged.push_back(i);
      total += slot_bytes(s.bytes);
    }
  }
  if (total == 0) return published;
  if (total > staging_bytes_) {
    staging_ = core::allocate_host_shared(total);
    staging_bytes_ = total;
  }
  auto* base = static_cast<std::byte*>(staging_.get());
  std::size_t at = 0;
  for (const std::size_t i : staged) {
    std::memcpy(base + at, spans[i].data, spans[i].bytes);
    core::SharedBlock b;
    if (!core::find_shared_block(base + at, spans[i].bytes, &b) || block_value(b) == 0)
      throw StateError(fmt::format("[rank {}] share_window: the window staging is not in a memfd block", rank));
    published[i] = {.value = block_value(b), .identity = b.identity, .bytes = spans[i].bytes};
    at += slot_bytes(spans[i].bytes);
  }
  copied.fetch_add(at, std::memory_order_relaxed);
  return published;
}

std::byte* PeerSharedViews::window(const Transport::PublishedSpan& published, std::size_t bytes) {
  if (published.value == 0) return nullptr;
  std::lock_guard lock(mutex_);
  if (!windows_) windows_ = std::make_unique<BlockViews>(owner_, true);
  return windows_->window(static_cast<int>((published.value & ~kBlock) >> kFdShift), published.identity,
                          static_cast<std::size_t>(published.value & kOffsetMask), bytes);
}

const void* PeerSharedViews::at(const void* published) {
  if (published == nullptr) return nullptr;
  const auto value = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(published));
  std::lock_guard lock(mutex_);
  if (value & kBlock) {
    if (!blocks_) blocks_ = std::make_unique<BlockViews>(owner_);
    return blocks_->at(static_cast<int>((value & ~kBlock) >> kFdShift), static_cast<std::size_t>(value & kOffsetMask));
  }
  if (!arena_) arena_ = std::make_unique<ArenaView>(owner_, arena_fd_);
  return arena_->at(static_cast<std::size_t>(value - 1), 0);
}

}  // namespace moe_ep::comm
