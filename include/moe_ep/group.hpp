// Groups of ranks and the in-process world.
//
// A Group is one rank's handle on a set of ranks that call collectives in the same order (as an
// MPI communicator). The ranks form a physical topology of `num_scaleout` nodes of
// `num_scaleup` ranks each (rank = node * num_scaleup + local index): ranks of one node share
// memory (scale-up), ranks of different nodes are reached only through the scale-out interface.
//
// LocalWorld runs N ranks as threads of this process (the embedded default). Any topology that
// divides N can be configured, so the multi-node code paths run in one process. When a rank's
// function returns or throws while peers still wait for it, the peers raise PeerError naming it
// at once; a rank that stays but does not arrive makes them raise TimeoutError after the
// timeout. Waits never hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace moe_ep {

namespace comm {
class Transport;
}

struct Topology {
  int num_scaleout = 1;  // nodes
  int num_scaleup = 0;   // ranks per node; 0 = all ranks in one node
};

class Group {
 public:
  explicit Group(std::shared_ptr<comm::Transport> transport);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const;
  int size() const;
  int num_scaleout() const;  // physical nodes
  int num_scaleup() const;   // ranks per node
  int scaleout_rank() const { return rank() / num_scaleup(); }
  int scaleup_rank() const { return rank() % num_scaleup(); }

  // Collective; timeout_secs = 0 means MOE_EP_TIMEOUT_SECS (timeouts: docs/semantics.md).
  void barrier(double timeout_secs = 0);
  // Collective: every rank's bytes (any length, each rank its own), by rank. `label` names the
  // exchange in the messages of its failures (a bad timeout_secs, a timeout, a rank that left).
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine, double timeout_secs = 0,
                                                 std::string_view label = "Group::all_gather");
  // Collective: a group of the same ranks on a channel of its own, whose collectives never pair
  // with this group's (it may outlive this group; collectives on it then fail cleanly once peers
  // are gone). `label` as in all_gather.
  std::shared_ptr<Group> duplicate(double timeout_secs = 0, std::string_view label = "Group::duplicate");

  // Ranks of the group running on this machine (they share its cores).
  int ranks_on_host() const;
  // Bytes this rank has sent to ranks of other nodes, over every channel of the group (monotonic).
  std::uint64_t scaleout_bytes_sent() const;
  // Bytes the group had to copy to show this rank's tensors to the ranks of its node (memory they
  // could not map in place), over every channel of the group (monotonic; docs/performance.md).
  std::uint64_t shared_bytes_copied() const;

  comm::Transport& transport() const { return *transport_; }

 private:
  std::shared_ptr<comm::Transport> transport_;
};

class LocalWorld {
 public:
  explicit LocalWorld(int num_ranks, Topology topology = {});
  ~LocalWorld();
  LocalWorld(const LocalWorld&) = delete;
  LocalWorld& operator=(const LocalWorld&) = delete;

  int size() const { return num_ranks_; }
  const Topology& topology() const { return topology_; }

  // Runs fn on every rank, each on its own thread, and joins them. If ranks threw, rethrows the
  // root cause: the lowest rank's error that is not a PeerError reaction to another rank, else
  // the lowest rank's error. Each call starts a fresh set of groups.
  void run(const std::function<void(Group&)>& fn);

 private:
  int num_ranks_;
  Topology topology_;
};

}  // namespace moe_ep
