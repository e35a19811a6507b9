#include "comm/transport.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <mutex>

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

void Transport::check_put_range(const SymmetricMemory& memory, std::size_t offset, std::size_t bytes) const {
  if (offset > memory.bytes() || bytes > memory.bytes() - offset)
    throw StateError(fmt::format("[rank {}] put of {} bytes at offset {} exceeds the {}-byte symmetric region",
                                 rank(), bytes, offset, memory.bytes()));
}

void Transport::check_allocation_agreed(std::size_t bytes, const std::vector<int>& failed,
                                        const std::vector<int>& mismatched) const {
  if (!failed.empty())
    throw PeerError(fmt::format("[rank {}] symmetric allocation of {} bytes failed on ranks [{}]", rank(), bytes,
                                fmt::join(failed, ", ")),
                    failed);
  if (!mismatched.empty())
    throw PeerError(fmt::format("[rank {}] symmetric allocation: ranks [{}] asked for a size other than {} bytes",
                                rank(), fmt::join(mismatched, ", "), bytes),
                    mismatched);
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

}  // namespace moe_ep
