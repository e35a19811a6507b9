// Where the ranks of a command run: every rank as a thread of this process (transport "local",
// the embedded default), or this process as one rank of an MPI job (transport "mpi", started by
// mpirun). Commands write one rank function and exchange per-rank results through the group, so
// the same code reports for both.
//
// A process started by an MPI launcher as one of N > 1 processes (Open MPI: OMPI_COMM_WORLD_SIZE;
// MPICH and Hydra: PMI_SIZE) runs as one rank of that job: without --transport it takes
// "mpi" (said once on stderr, by rank 0), and "local" is refused (it would run N independent
// jobs). "mpi" and "host" are refused without a launcher. resolve_transport applies these rules
// and throws UsageError, before anything is started.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moe_ep/group.hpp"

namespace moe_ep::tools {

struct LaunchOptions {
  std::string transport = "local";  // local | mpi | host (processes of one host, started by mpirun)
  bool transport_given = false;     // --transport on the command line
  bool announce = false;            // rank 0 says on stderr that the launcher chose "mpi"
  int ranks = 8;                    // local: threads; mpi: must match the job (or be left unset)
  bool ranks_given = false;
  int nodes = 1;                    // logical nodes
  int ranks_per_node = 0;           // overrides nodes when > 0
};

class Launch {
 public:
  virtual ~Launch() = default;
  virtual int size() const = 0;
  virtual Topology topology() const = 0;  // num_scaleup filled in
  // Runs fn on every rank of this process; rethrows the root cause of a failure.
  virtual void run(const std::function<void(Group&)>& fn) = 0;
  virtual bool reports() const = 0;  // this process prints the report (holds rank 0)
  virtual std::string describe() const = 0;
};

// The number of processes of the MPI job whose launcher started this process; 0 when none did.
int launcher_size();

// Chooses the transport from --transport and the launcher (see above); throws UsageError.
void resolve_transport(LaunchOptions& options);

// MPI is initialized here for transport "mpi" (and finalized when the launch ends cleanly).
std::unique_ptr<Launch> make_launch(int* argc, char*** argv, const LaunchOptions& options);

// Every rank's block, on every rank (a world all-gather over the group).
std::vector<std::vector<std::byte>> gather_blocks(Group& group, std::span<const std::byte> mine);

}  // namespace moe_ep::tools
