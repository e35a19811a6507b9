#include "launch.hh"

#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cli.hh"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/host.hpp"
#ifdef MOE_EP_WITH_MPI
#include "moe_ep/mpi.hpp"
#endif

namespace moe_ep::tools {
namespace {

#ifdef MOE_EP_WITH_MPI
constexpr bool kWithMpi = true;
#else
constexpr bool kWithMpi = false;
#endif

// A launcher's process count (a registry variable, 0 when unset); a value that is not a number is
// an InvalidArgument naming the variable.
int positive_env(env::IntVar variable) { return static_cast<int>(env::get(variable)); }

Topology local_topology(const LaunchOptions& o) {
  if (o.ranks_per_node > 0) {
    if (o.ranks % o.ranks_per_node != 0)
      throw InvalidArgument(fmt::format("--ranks-per-node {} does not divide --ranks {}", o.ranks_per_node, o.ranks));
    return {.num_scaleout = o.ranks / o.ranks_per_node, .num_scaleup = o.ranks_per_node};
  }
  return {.num_scaleout = o.nodes};
}

class ThreadLaunch final : public Launch {
 public:
  explicit ThreadLaunch(const LaunchOptions& o) : world_(o.ranks, local_topology(o)) {}
  int size() const override { return world_.size(); }
  Topology topology() const override { return world_.topology(); }
  void run(const std::function<void(Group&)>& fn) override { world_.run(fn); }
  bool reports() const override { return true; }
  std::string describe() const override { return fmt::format("{} ranks as threads", world_.size()); }

 private:
  LocalWorld world_;
};

#ifdef MOE_EP_WITH_MPI
class MpiLaunch final : public Launch {
 public:
  MpiLaunch(int* argc, char*** argv, const LaunchOptions& o) : transport_(o.transport), session_(argc, argv) {
    mpi::GroupOptions options;
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (o.ranks_given && o.ranks != size)
      throw InvalidArgument(fmt::format("--ranks {} does not match the {} processes of the MPI job", o.ranks, size));
    if (o.ranks_per_node > 0) {
      options.ranks_per_node = o.ranks_per_node;
    } else if (o.nodes > 1) {
      if (size % o.nodes != 0)
        throw InvalidArgument(fmt::format("--nodes {} does not divide the {} processes of the MPI job", o.nodes, size));
      options.ranks_per_node = size / o.nodes;
    }
    try {
      if (o.transport == "host") {
        // Processes of one host over shared memory; MPI only carries the bootstrap exchange.
        host::GroupOptions host_options;
        host_options.ranks_per_node = options.ranks_per_node;
        int rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        group_ = host::make_group(rank, size, [&](const std::string& mine) { return allgather(mine, size); },
                                  host_options);
      } else {
        group_ = mpi::make_group(MPI_COMM_WORLD, options);
      }
    } catch (...) {
      mpi::Session::abandon();
      throw;
    }
    if (o.announce && group_->rank() == 0)
      std::fprintf(stderr, "moe-ep: started by an MPI launcher as %d processes: using --transport mpi\n", size);
  }
  int size() const override { return group_->size(); }
  Topology topology() const override { return {group_->num_scaleout(), group_->num_scaleup()}; }
  void run(const std::function<void(Group&)>& fn) override {
    try {
      fn(*group_);
    } catch (...) {
      // Peers may be gone or out of step: leave without the collective finalization.
      mpi::Session::abandon();
      throw;
    }
  }
  bool reports() const override { return group_->rank() == 0; }
  std::string describe() const override {
    return fmt::format("{} MPI processes{}", group_->size(), transport_ == "host" ? " (host transport)" : "");
  }

 private:
  static std::vector<std::string> allgather(const std::string& mine, int size) {
    const int bytes = static_cast<int>(mine.size());
    std::vector<int> counts(static_cast<size_t>(size)), offsets(static_cast<size_t>(size));
    MPI_Allgather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
    int total = 0;
    for (int r = 0; r < size; ++r) {
      offsets[static_cast<size_t>(r)] = total;
      total += counts[static_cast<size_t>(r)];
    }
    std::string all(static_cast<size_t>(total), '\0');
    MPI_Allgatherv(mine.data(), bytes, MPI_CHAR, all.data(), counts.data(), offsets.data(), MPI_CHAR, MPI_COMM_WORLD);
    std::vector<std::string> out;
    for (int r = 0; r < size; ++r)
      out.push_back(all.substr(static_cast<size_t>(offsets[static_cast<size_t>(r)]),
                               static_cast<size_t>(counts[static_cast<size_t>(r)])));
    return out;
  }

  std::string transport_;
  mpi::Session session_;
  std::unique_ptr<Group> group_;
};
#endif

}  // namespace

int launcher_size() {
  // Open MPI's mpirun/mpiexec, then MPICH's and Intel MPI's Hydra (and srun with PMI).
  if (const int n = positive_env(env::kOmpiCommWorldSize); n > 0) return n;
  return positive_env(env::kPmiSize);
}

void resolve_transport(LaunchOptions& o) {
  const int job = launcher_size();
  if (!o.transport_given) {
    o.transport = "local";
    if (job > 1) {
      if (!kWithMpi)
        throw UsageError(fmt::format("started by an MPI launcher as {} processes, but this moe-ep was built without "
                                     "MPI (MOE_EP_WITH_MPI=OFF): run one process (ranks as threads)",
                                     job));
      o.transport = "mpi";
      o.announce = true;
    }
    return;
  }
  if (o.transport == "local" && job > 1)
    throw UsageError(fmt::format("started by an MPI launcher as {0} processes; --transport local would run {0} "
                                 "independent jobs: use --transport mpi or host (or run one process)",
                                 job));
  if (o.transport == "mpi" || o.transport == "host") {
    if (!kWithMpi)
      throw UsageError(fmt::format("--transport {}: this moe-ep was built without MPI (MOE_EP_WITH_MPI=OFF)",
                                   o.transport));
    if (job == 0)
      throw UsageError(fmt::format("--transport {0}: this process was not started by an MPI launcher: start it with "
                                   "`mpirun -np N moe-ep ... --transport {0}`",
                                   o.transport));
  }
}

std::unique_ptr<Launch> make_launch(int* argc, char*** argv, const LaunchOptions& options) {
  if (options.transport == "local") return std::make_unique<ThreadLaunch>(options);
  if (options.transport == "mpi" || options.transport == "host") {
#ifdef MOE_EP_WITH_MPI
    return std::make_unique<MpiLaunch>(argc, argv, options);
#else
    throw InvalidArgument(fmt::format("--transport {}: this moe-ep was built without MPI (MOE_EP_WITH_MPI=OFF)",
                                      options.transport));
#endif
  }
  throw InvalidArgument(fmt::format("--transport is '{}', expected local, mpi or host", options.transport));
}

std::vector<std::vector<std::byte>> gather_blocks(Group& group, std::span<const std::byte> mine) {
  return group.all_gather(mine, 0, "report: result exchange");  // 0: MOE_EP_TIMEOUT_SECS
}

}  // namespace moe_ep::tools
