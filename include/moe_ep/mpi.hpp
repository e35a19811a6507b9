// Groups of MPI processes (library moe_ep_mpi).
//
// make_group() turns any MPI communicator into a Group: one rank per process, rank = rank in the
// communicator. Ranks of one node share memory (MPI_Win_allocate_shared windows for the
// symmetric heap, flags and counters); ranks of different nodes exchange scale-out records as
// MPI messages with counted completion. A node is, by default, the ranks of one host
// (MPI_COMM_TYPE_SHARED); `ranks_per_node` (or MOE_EP_RANKS_PER_NODE) sets a smaller logical
// node, so that processes of one host can take the multi-node paths. Nodes must be contiguous
// blocks of ranks of equal size.
//
// Every wait has a timeout and names the ranks it waited for and the phase; a process of this
// host that died is reported as soon as it is noticed. Nothing this library creates has a name
// in a file system except what MPI itself creates for its shared windows.
#pragma once

#include <mpi.h>

#include <memory>
#include <optional>

#include "moe_ep/group.hpp"

namespace moe_ep::mpi {

struct GroupOptions {
  std::optional<int> ranks_per_node;  // unset: MOE_EP_RANKS_PER_NODE (0 = the ranks of each host)
  double timeout_secs = 0;            // group creation; 0: MOE_EP_TIMEOUT_SECS
};

// Collective over `comm` (which it duplicates; `comm` may be freed afterwards). Throws
// InvalidArgument for MPI_COMM_NULL, an intercommunicator or a topology that does not fit the
// communicator, StateError when MPI is not initialized (or too few threads), PeerError naming the ranks
// when ranks ask for different topologies, TimeoutError when a rank does not arrive.
std::unique_ptr<Group> make_group(MPI_Comm comm, const GroupOptions& options = {});

// MPI for the lifetime of this object: initializes with MPI_THREAD_MULTIPLE unless MPI is
// already initialized (then at least MPI_THREAD_SERIALIZED is required), finalizes at the end
// if it initialized. abandon() skips the finalization (after a failure, when peers may be gone).
class Session {
 public:
  Session(int* argc, char*** argv);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  int thread_level() const { return provided_; }
  static void abandon();

 private:
  bool owns_ = false;
  int provided_ = 0;
};

}  // namespace moe_ep::mpi
