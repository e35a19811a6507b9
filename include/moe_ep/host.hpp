// Groups of processes of one host, without MPI (library moe_ep).
//
// make_group() connects `size` processes of this host into a Group: one rank per process. The
// processes introduce themselves once through an all-gather the caller supplies (for Python, e.g.
// torch.distributed's all_gather_object over a gloo group); from then on every collective,
// symmetric memory, put/signal and shared tensor goes through shared memory (memfds the peers map
// through /proc/<pid>/fd), so the library depends on neither MPI nor torch. All processes must
// run on one host and in one pid namespace; across hosts use the MPI transport (moe_ep/mpi.hpp).
//
// The ranks form `size / ranks_per_node` logical nodes of `ranks_per_node` ranks (default: one
// node of all ranks), so that the multi-node paths run on one host. Every wait has a timeout and
// names the ranks it waited for and the phase; a peer process that exited or was killed is
// reported at once (PeerError naming it). Nothing has a name in any file system: when the
// processes exit or are killed, nothing is left behind.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/group.hpp"

namespace moe_ep::host {

// Exchanges one byte string per process; returns every process's string indexed by rank
// (size() == size).
using AllGather = std::function<std::vector<std::string>(const std::string& mine)>;

struct GroupOptions {
  std::optional<int> ranks_per_node;  // unset: MOE_EP_RANKS_PER_NODE (0 = all ranks one node)
  double timeout_secs = 0;            // 0: MOE_EP_TIMEOUT_SECS
};

// Collective over the `size` processes; all_gather is called exactly once by make_group (and
// never kept). Throws InvalidArgument for a rank or size out of range, processes on different
// hosts, or a ranks_per_node that does not divide size; PeerError naming the ranks when they ask
// for different ranks_per_node; StateError when all_gather returns the wrong number of blocks or
// blocks make_group did not write, or when the peers' processes are not visible (another pid
// namespace); TimeoutError when a rank does not arrive after the exchange.
std::unique_ptr<Group> make_group(int rank, int size, const AllGather& all_gather, const GroupOptions& options = {});

}  // namespace moe_ep::host
