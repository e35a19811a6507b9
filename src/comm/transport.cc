#include "comm/transport.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <map>
#include <mutex>

#include "comm/disagreement.hh"
#include "core/timeout.hh"
#include "moe_ep/error.hpp"

namespace moe_ep {
namespace comm {

void Transport::fail_left_channel(const Wait& wait, const std::string& reason) const {
  throw StateError(fmt::format("[rank {}] {}: this rank left the channel after a failure ({}); create a new group or "
                               "buffer",
                               rank(), wait.phase, reason));
}

void Transport::check_peer(int peer, const char* phase) const {
  auto why = departure(peer);
  if (why) fail_departed(rank(), phase, peer, std::move(*why));
}

void Transport::check_rank(int peer) const {
  if (peer < 0 || peer >= size())
    throw StateError(fmt::format("[rank {}] rank {} is outside the group of {} ranks", rank(), peer, size()));
}

void Transport::check_same_node(int peer) const {
  check_rank(peer);
  if (!same_node(peer))
    throw StateError(fmt::format(
        "[rank {}] rank {} is on node {}, not on this rank's node {}: it is reachable only through the "
        "scale-out interface",
        rank(), peer, node_of(peer), node_of(rank())));
}

std::vector<Transport::PublishedSpan> Transport::share_window(std::span<const WindowSpan> spans) {
  if (!offers_windows())
    throw StateError(fmt::format("[rank {}] share_window: this transport offers no windows (its ranks pull)", rank()));
  std::vector<PublishedSpan> out;
  out.reserve(spans.size());
  for (const WindowSpan& s : spans)
    out.push_back({.value = s.bytes ? reinterpret_cast<std::uintptr_t>(s.data) : 0, .bytes = s.bytes});
  return out;
}

std::byte* Transport::node_window(int peer, const PublishedSpan& published, std::size_t bytes) const {
  check_same_node(peer);
  if (!offers_windows())
    throw StateError(fmt::format("[rank {}] node_window: this transport offers no windows (its ranks pull)", rank()));
  if (bytes > published.bytes || (bytes > 0 && published.value == 0))
    throw StateError(fmt::format("[rank {}] window of rank {}: {} bytes needed, it published a span of {}", rank(),
                                 peer, bytes, published.value == 0 ? 0 : published.bytes));
  return map_window(peer, published, bytes);
}

std::byte* Transport::map_window(int, const PublishedSpan& published, std::size_t) const {
  return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(published.value));
}

void Transport::check_put_range(const SymmetricMemory& memory, std::size_t offset, std::size_t bytes) const {
  if (offset > memory.bytes() || bytes > memory.bytes() - offset)
    throw StateError(fmt::format("[rank {}] put of {} bytes at offset {} exceeds the {}-byte symmetric region",
                                 rank(), bytes, offset, memory.bytes()));
}

void Transport::check_allocation_agreed(std::size_t bytes, const std::vector<int>& failed,
                                        const std::vector<std::uint64_t>& sizes) const {
  if (!failed.empty())
    throw PeerError(fmt::format("[rank {}] symmetric allocation of {} bytes failed on ranks [{}]", rank(), bytes,
                                fmt::join(failed, ", ")),
                    failed);
  std::map<int, std::string> held;
  for (std::size_t r = 0; r < sizes.size(); ++r) held[static_cast<int>(r)] = fmt::format("{} bytes", sizes[r]);
  if (auto e = disagreement(fmt::format("[rank {}] symmetric allocation", rank()), "the size", held, rank())) throw *e;
}

void retire(std::shared_ptr<SymmetricMemory> memory) {
  if (memory && memory->peers_hold_own_mappings()) return;  // released here; the peers keep theirs
  static std::mutex mutex;
  static auto* retired = new std::vector<std::shared_ptr<SymmetricMemory>>();  // reachable until exit
  std::lock_guard lock(mutex);
  retired->push_back(std::move(memory));
}

Topology resolve_topology(int num_ranks, Topology topology) {
  if (num_ranks < 1) throw InvalidArgument(fmt::format("num_ranks is {}, expected at least 1", num_ranks));
  if (topology.num_scaleout < 1)
    throw InvalidArgument(fmt::format("topology num_scaleout is {}, expected at least 1", topology.num_scaleout));
  if (topology.num_scaleup == 0) {
    if (num_ranks % topology.num_scaleout != 0)
      throw InvalidArgument(fmt::format("topology num_scaleout {} does not divide the {} ranks",
                                        topology.num_scaleout, num_ranks));
    topology.num_scaleup = num_ranks / topology.num_scaleout;
  }
  if (topology.num_scaleup < 1 || topology.num_scaleout * topology.num_scaleup != num_ranks)
    throw InvalidArgument(fmt::format("topology {} x {} does not match the {} ranks of the group",
                                      topology.num_scaleout, topology.num_scaleup, num_ranks));
  return topology;
}

void Transport::put_formed(int peer, SymmetricMemory& memory, std::size_t offset, std::size_t bytes,
                           const std::function<void(std::byte*)>& form) {
  std::vector<std::byte> formed(bytes);
  form(formed.data());
  put(peer, memory, offset, formed.data(), bytes);
}

}  // namespace comm

Group::Group(std::shared_ptr<comm::Transport> transport) : transport_(std::move(transport)) {}
Group::~Group() = default;
int Group::rank() const { return transport_->rank(); }
int Group::size() const { return transport_->size(); }
int Group::num_scaleout() const { return transport_->topology().num_scaleout; }
int Group::num_scaleup() const { return transport_->topology().num_scaleup; }

void Group::barrier(double timeout_secs) {
  timeout_secs = core::timeout_or_env(fmt::format("[rank {}] Group::barrier", rank()), timeout_secs);
  transport_->barrier(comm::Scope::kWorld, {"Group::barrier", timeout_secs});
}

std::vector<std::vector<std::byte>> Group::all_gather(std::span<const std::byte> mine, double timeout_secs,
                                                      std::string_view label) {
  timeout_secs = core::timeout_or_env(label, timeout_secs);
  const std::string phase(label);
  const comm::Gathered all = transport_->all_gather(mine, comm::Scope::kWorld, {phase.c_str(), timeout_secs});
  std::vector<std::vector<std::byte>> blocks;
  blocks.reserve(static_cast<std::size_t>(all.size()));
  for (int r = 0; r < all.size(); ++r) blocks.emplace_back(all[r].begin(), all[r].end());
  return blocks;
}

std::shared_ptr<Group> Group::duplicate(double timeout_secs, std::string_view label) {
  timeout_secs = core::timeout_or_env(label, timeout_secs);
  const std::string phase(label);
  return std::make_shared<Group>(transport_->duplicate({phase.c_str(), timeout_secs}));
}

int Group::ranks_on_host() const { return transport_->ranks_on_host(); }
std::uint64_t Group::scaleout_bytes_sent() const { return transport_->scaleout_bytes_sent(); }
std::uint64_t Group::shared_bytes_copied() const { return transport_->shared_bytes_copied(); }

}  // namespace moe_ep
