// Control pages: what the processes of one host learn about each other's part in a channel
// through shared memory, and whether a process of this host is still there.
//
// Every rank owns one ControlPage per channel, at the start of a memfd (no name in any file
// system) that its peers open through /proc/<pid>/fd/<fd> and map: whether the rank abandoned
// the channel (with why), how many peer-read sections it has open (Transport's PeerReads) and the
// collectives it completed per scope. Only the owner writes its page. A transport may make the
// memfd larger and keep its own state after the page (ControlRegion::extra()).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
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

// The first `bytes` of a peer's control region (process `pid`, descriptor `fd`), mapped here, or
// null when it cannot be opened (*error says why). Unmap with munmap(p, bytes).
void* map_peer_region(pid_t pid, int fd, std::size_t bytes, bool writable, std::string* error);

// A process that no longer exists, or that exited and waits to be reaped.
bool process_gone(pid_t pid);

}  // namespace moe_ep::comm
