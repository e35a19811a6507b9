// Control pages: what the processes of one host learn about each other's part in a channel
// through shared memory, and whether a process of this host is still there.
//
// Every rank owns one ControlPage per channel, at the start of a memfd (no name in any file
// system) that its peers open through /proc/<pid>/fd/<fd> and map: whether the rank abandoned
// the channel (with why), how many peer-read sections it has open (Transport's PeerReads) and the
// collectives it completed per scope. Only the owner writes its page. A transport may make the
// memfd larger and keep its own state after the page (ControlRegion::extra()). ControlPages is a
// rank's view of its peers' pages: what the host and MPI transports read of their peers' part in
// a channel (abandonment, open peer-read sections, completed collectives).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/transport.hh"

namespace moe_ep::comm {

struct ControlPage {
  static constexpr std::size_t kBytes = 4096;
  static constexpr std::size_t kMaxCulprits = 64;
  alignas(64) std::atomic<std::uint64_t> abandoned;
  alignas(64) std::atomic<std::uint64_t> reading;
  alignas(64) std::atomic<std::uint64_t> completed[2];  // collectives completed per scope (world, node)
  alignas(64) std::uint32_t num_culprits;
  std::int32_t culprits[kMaxCulprits];
  std::uint32_t reason_bytes;
  char reason[kBytes - 64 * 4 - 4 * (kMaxCulprits + 2)];

  // Records that the owner abandoned the channel (reason first, then the flag, seq_cst). Returns
  // false if it had already.
  bool abandon(const std::string& why, const std::vector<int>& culprits_named) noexcept;
  bool has_abandoned() const { return abandoned.load(std::memory_order_seq_cst) != 0; }
  std::string read_reason() const;
  Departure read_departure() const;  // gave_up(reason, culprits)
};
static_assert(sizeof(ControlPage) <= ControlPage::kBytes);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

// This rank's control page, followed by `extra_bytes` (zeroed) for the transport's own state.
class ControlRegion {
 public:
  explicit ControlRegion(std::size_t extra_bytes = 0);
  ~ControlRegion();
  ControlRegion(const ControlRegion&) = delete;
  ControlRegion& operator=(const ControlRegion&) = delete;
  int fd() const { return fd_; }
  std::size_t bytes() const { return bytes_; }
  ControlPage& page() const { return *page_; }
  std::byte* extra() const { return reinterpret_cast<std::byte*>(page_) + ControlPage::kBytes; }

 private:
  int fd_ = -1;
  std::size_t bytes_ = 0;
  ControlPage* page_ = nullptr;
};

// The control pages of a run of a channel's ranks (first, first + 1, ...; this rank's own among
// them) as this process sees them. A rank whose page is missing (outside the run, not added yet,
// or not mappable) reads as taking part, with no section open. Unmaps the pages it mapped
// (add_mapped) when cleared or destroyed; this rank's own page belongs to its ControlRegion.
class ControlPages {
 public:
  explicit ControlPages(int first = 0) : first_(first) {}
  ~ControlPages() { clear(); }
  ControlPages(const ControlPages&) = delete;
  ControlPages& operator=(const ControlPages&) = delete;

  // The next rank's page: this rank's own, or a peer's mapping of `mapped_bytes` (null when it
  // could not be mapped).
  void add_own(const ControlPage& page) { entries_.push_back({&page, 0}); }
  void add_mapped(const ControlPage* page, std::size_t mapped_bytes) { entries_.push_back({page, mapped_bytes}); }
  void clear() noexcept;

  const ControlPage* of(int rank) const;
  bool has_abandoned(int rank) const {
    const ControlPage* page = of(rank);
    return page != nullptr && page->has_abandoned();
  }
  // Why `rank` abandoned the channel, or nullopt.
  std::optional<Departure> abandonment(int rank) const;
  // Why `rank` abandoned the channel before completing collective `epoch` of scope `scope_index`.
  std::optional<Departure> abandoned_before(int rank, int scope_index, std::uint64_t epoch) const;
  // Its count of open peer-read sections, or null.
  const std::atomic<std::uint64_t>* open_sections(int rank) const {
    const ControlPage* page = of(rank);
    return page == nullptr ? nullptr : &page->reading;
  }

 private:
  struct Entry {
    const ControlPage* page;
    std::size_t mapped_bytes;  // 0: not mapped by this object
  };
  int first_;
  std::vector<Entry> entries_;
};

// The first `bytes` of a peer's control region (process `pid`, descriptor `fd`), mapped here, or
// null when it cannot be opened (*error says why). Unmap with munmap(p, bytes).
void* map_peer_region(pid_t pid, int fd, std::size_t bytes, bool writable, std::string* error);

// A process that no longer exists, or that exited and waits to be reaped. Once true for a pid it stays
// true (a process reaped while it is looked at counts as gone), so a wait that saw a departure names it.
bool process_gone(pid_t pid);

}  // namespace moe_ep::comm
