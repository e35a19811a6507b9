#include "comm/control_page.hh"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>

#include "moe_ep/error.hpp"

namespace moe_ep::comm {

bool ControlPage::abandon(const std::string& why, const std::vector<int>& culprits_named) noexcept {
  if (abandoned.load(std::memory_order_relaxed) != 0) return false;
  num_culprits = static_cast<std::uint32_t>(std::min(culprits_named.size(), kMaxCulprits));
  for (std::uint32_t i = 0; i < num_culprits; ++i) culprits[i] = culprits_named[i];
  reason_bytes = static_cast<std::uint32_t>(std::min(why.size(), sizeof reason));
  std::memcpy(reason, why.data(), reason_bytes);
  // seq_cst: either a peer opening a peer-read section sees this flag, or the owner (after this)
  // sees its section open.
  abandoned.store(1, std::memory_order_seq_cst);
  return true;
}

std::string ControlPage::read_reason() const {
  return std::string(reason, std::min<std::size_t>(reason_bytes, sizeof reason));
}

Departure ControlPage::read_departure() const {
  const std::uint32_t n = std::min<std::uint32_t>(num_culprits, kMaxCulprits);
  return gave_up(read_reason(), std::vector<int>(culprits, culprits + n));
}

void ControlPages::clear() noexcept {
  for (const Entry& entry : entries_)
    if (entry.page != nullptr && entry.mapped_bytes != 0) munmap(const_cast<ControlPage*>(entry.page), entry.mapped_bytes);
  entries_.clear();
}

const ControlPage* ControlPages::of(int rank) const {
  const int index = rank - first_;
  if (index < 0 || index >= static_cast<int>(entries_.size())) return nullptr;
  return entries_[static_cast<size_t>(index)].page;
}

std::optional<Departure> ControlPages::abandonment(int rank) const {
  const ControlPage* page = of(rank);
  if (page == nullptr || !page->has_abandoned()) return std::nullopt;
  return page->read_departure();
}

std::optional<Departure> ControlPages::abandoned_before(int rank, int scope_index, std::uint64_t epoch) const {
  const ControlPage* page = of(rank);
  if (page == nullptr || !page->has_abandoned() || page->completed[scope_index].load(std::memory_order_acquire) >= epoch)
    return std::nullopt;
  return page->read_departure();
}

ControlRegion::ControlRegion(std::size_t extra_bytes) : bytes_(ControlPage::kBytes + extra_bytes) {
  fd_ = memfd_create("moe-ep-control", MFD_CLOEXEC);
  if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
    const std::string why = std::strerror(errno);
    if (fd_ >= 0) close(fd_);
    throw StateError(fmt::format("control page: memfd_create failed: {}", why));
  }
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const std::string why = std::strerror(errno);
    close(fd_);
    throw StateError(fmt::format("control page: mmap of {} bytes failed: {}", bytes_, why));
  }
  page_ = new (p) ControlPage{};
}

ControlRegion::~ControlRegion() {
  if (page_) munmap(page_, bytes_);
  if (fd_ >= 0) close(fd_);
}

void* map_peer_region(pid_t pid, int fd, std::size_t bytes, bool writable, std::string* error) {
  if (pid <= 0) {
    *error = "its process is not visible from this one";
    return nullptr;
  }
  const std::string path = fmt::format("/proc/{}/fd/{}", pid, fd);
  const int mine = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (mine < 0) {
    *error = fmt::format("cannot open {}: {}", path, std::strerror(errno));
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, mine, 0);
  const int mmap_errno = errno;
  close(mine);
  if (p == MAP_FAILED) {
    *error = fmt::format("cannot map {} bytes of {}: {}", bytes, path, std::strerror(mmap_errno));
    return nullptr;
  }
  return p;
}

bool process_gone(pid_t pid) {
  if (pid <= 0) return false;
  const auto no_process = [pid] { return kill(pid, 0) != 0 && errno == ESRCH; };
  if (no_process()) return true;
  // A zombie is gone too. An entry that opens but reads empty belongs to a process being reaped
  // while this looks at it (a live process's entry always reads); one that does not open is judged
  // by kill again (it may be missing for a reason of its own, /proc not mounted).
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  if (!stat) return no_process();
  std::string line;
  if (!std::getline(stat, line)) return true;
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace moe_ep::comm
