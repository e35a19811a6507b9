// NUMA placement of one rank: which NUMA node its thread and its workers run on and which PUs
// (processing units, by OS index) each of them is bound to. plan_placement is pure (it reads the
// given hwloc topology only); apply_placement binds the calling thread and never throws: a failed
// binding is a warning. Policy (docs/performance.md, "NUMA placement"): one NUMA node = no
// binding; several = rank i of n on node floor(i * nodes / n), the ranks of a node sharing its
// cores in contiguous shares (one core per thread) when there are enough, else the whole node.
#pragma once

#include <hwloc.h>

#include <memory>
#include <string>
#include <vector>

namespace moe_ep::core {

struct Placement {
  bool bound = false;            // false: no binding ("none"); the other fields are empty
  int numa_node = -1;            // logical index of the NUMA node
  std::vector<unsigned> node_pus;  // every PU of the node
  std::vector<unsigned> share_pus;  // the rank's share (the whole node when cores are too few)
  std::vector<unsigned> rank_pus;  // the rank thread's PUs
  std::vector<std::vector<unsigned>> worker_pus;  // one list per worker
  std::string describe() const;    // one line for the log
};

struct PlacementRequest {
  int ranks_on_host = 1;
  int host_rank = 0;        // this rank's index among the ranks of its host
  int workers = 0;          // worker threads of the rank (besides its own thread)
  bool enabled = true;      // MOE_EP_PLACEMENT=auto
  std::vector<int> nodes;   // the explicit mapping (MOE_EP_NUMA_NODES), one node per host rank; empty = blocks
};

// Parses MOE_EP_NUMA_NODES-style text: empty = {}; else exactly ranks_on_host indexes in
// [0, num_nodes). Anything else is an InvalidArgument naming the variable, the value and the limit.
std::vector<int> parse_numa_nodes(const std::string& text, int ranks_on_host, int num_nodes);

// InvalidArgument for host_rank outside [0, ranks_on_host) or a bad explicit mapping.
Placement plan_placement(hwloc_topology_t topology, const PlacementRequest& request);

// The request of this process from MOE_EP_PLACEMENT and MOE_EP_NUMA_NODES (parsed against topology).
PlacementRequest placement_request_from_env(hwloc_topology_t topology, int ranks_on_host, int host_rank, int workers);

// Binds the calling thread to pus (HWLOC_CPUBIND_THREAD); what it first touches then lives on its
// node (Linux's local allocation). No-op when !placement.bound or pus is empty.
void apply_placement(const Placement& placement, const std::vector<unsigned>& pus) noexcept;

// Plans this rank's placement on this host (MOE_EP_NUM_WORKERS workers), logs it at INFO, binds
// the calling thread and records the placement for the threads it starts (worker_pus(i)). A bad
// MOE_EP_NUMA_NODES is an InvalidArgument; a failed binding a warning.
void place_rank_thread(int ranks_on_host, int host_rank);

// The PUs of worker i (from 0) of the calling thread's rank: its planned core, else the rank's
// share; empty when the rank is not bound. place_worker_thread binds to them; both are for the
// executor, which passes the creator's placement (thread_placement()) to its threads.
std::shared_ptr<const Placement> thread_placement() noexcept;
void place_worker_thread(const std::shared_ptr<const Placement>& placement, int worker) noexcept;

// The topology of this machine, loaded once (nullptr if hwloc could not load it).
hwloc_topology_t host_topology() noexcept;

}  // namespace moe_ep::core
