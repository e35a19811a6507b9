#include "core/placement.hh"

#include <fmt/format.h>

#include <charconv>
#include <mutex>
#include <optional>
#include <string_view>

#include "core/env_vars.hh"
#include "core/log.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::core {
namespace {

std::vector<unsigned> pus_of(hwloc_topology_t topology, hwloc_const_cpuset_t set) {
  std::vector<unsigned> pus;
  const int n = hwloc_get_nbobjs_inside_cpuset_by_type(topology, set, HWLOC_OBJ_PU);
  for (int i = 0; i < n; ++i) pus.push_back(hwloc_get_obj_inside_cpuset_by_type(topology, set, HWLOC_OBJ_PU, i)->os_index);
  return pus;
}

std::string pu_list(const std::vector<unsigned>& pus) { return fmt::format("{}", fmt::join(pus, ",")); }

hwloc_bitmap_t bitmap_of(const std::vector<unsigned>& pus) {
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  for (unsigned pu : pus) hwloc_bitmap_set(set, pu);
  return set;
}

}  // namespace

std::string Placement::describe() const {
  if (!bound) return "none";
  std::string s = fmt::format("numa node {}, rank PUs {}", numa_node, pu_list(rank_pus));
  for (std::size_t w = 0; w < worker_pus.size(); ++w) s += fmt::format(", worker {} PUs {}", w, pu_list(worker_pus[w]));
  return s;
}

namespace {

// The indexes of a MOE_EP_NUMA_NODES list (empty: none) into `nodes`; returns the first item that
// is no index (not a non-negative decimal int), or nothing when every item is one.
std::optional<std::string> read_numa_nodes(std::string_view text, std::vector<int>& nodes) {
  nodes.clear();
  if (text.empty()) return std::nullopt;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string_view item = text.substr(start, comma == std::string_view::npos ? text.npos : comma - start);
    int value = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc{} || end != item.data() + item.size() || value < 0) return std::string(item);
    nodes.push_back(value);
    if (comma == std::string_view::npos) return std::nullopt;
    start = comma + 1;
  }
}

std::string numa_nodes_problem(std::string_view text) {
  std::vector<int> nodes;
  const std::optional<std::string> bad = read_numa_nodes(text, nodes);
  return bad ? fmt::format("{:?} is not a NUMA node index", *bad) : std::string();
}

}  // namespace

// The registry's rule of MOE_EP_NUMA_NODES: the syntax parse_numa_nodes reads (the count and the
// node range depend on the host, and are checked there).
constinit const env::Syntax kNumaNodesSyntax{
    "a comma-separated list of NUMA node indexes (0, 1, ...), one per rank of the host; empty = the block mapping",
    &numa_nodes_problem};

std::vector<int> parse_numa_nodes(const std::string& text, int ranks_on_host, int num_nodes) {
  std::vector<int> nodes;
  if (text.empty()) return nodes;  // the block mapping
  if (const std::optional<std::string> bad = read_numa_nodes(text, nodes))
    throw InvalidArgument(fmt::format("MOE_EP_NUMA_NODES=\"{}\": \"{}\" is not a NUMA node index (0 to {})", text,
                                      *bad, num_nodes - 1));
  for (const int node : nodes)
    if (node >= num_nodes)
      throw InvalidArgument(fmt::format("MOE_EP_NUMA_NODES=\"{}\": node {} is out of range: this host has {} NUMA "
                                        "nodes (0 to {})", text, node, num_nodes, num_nodes - 1));
  if (static_cast<int>(nodes.size()) != ranks_on_host)
    throw InvalidArgument(fmt::format("MOE_EP_NUMA_NODES=\"{}\": {} entries, but the host has {} ranks (one entry "
                                      "per rank)", text, nodes.size(), ranks_on_host));
  return nodes;
}

Placement plan_placement(hwloc_topology_t topology, const PlacementRequest& r) {
  if (r.ranks_on_host < 1 || r.host_rank < 0 || r.host_rank >= r.ranks_on_host)
    throw InvalidArgument(fmt::format("placement: host_rank {} is outside [0, ranks_on_host {})", r.host_rank,
                                      r.ranks_on_host));
  Placement p;
  const int num_nodes = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
  if (!r.enabled || num_nodes <= 1) return p;
  if (!r.nodes.empty() && static_cast<int>(r.nodes.size()) != r.ranks_on_host)
    throw InvalidArgument(fmt::format("placement: {} NUMA nodes given for {} ranks on the host", r.nodes.size(),
                                      r.ranks_on_host));
  auto node_of = [&](int i) {
    return r.nodes.empty() ? static_cast<int>(static_cast<long long>(i) * num_nodes / r.ranks_on_host) : r.nodes[i];
  };
  const int node = node_of(r.host_rank);
  if (node < 0 || node >= num_nodes)
    throw InvalidArgument(fmt::format("placement: NUMA node {} is outside [0, {})", node, num_nodes));
  // This rank's position among the ranks of its node, and their number.
  int index = 0, sharing = 0;
  for (int i = 0; i < r.ranks_on_host; ++i) {
    if (node_of(i) != node) continue;
    if (i < r.host_rank) ++index;
    ++sharing;
  }
  hwloc_obj_t numa = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
  p.bound = true;
  p.numa_node = node;
  p.node_pus = pus_of(topology, numa->cpuset);
  const int threads = 1 + r.workers;
  const int cores = hwloc_get_nbobjs_inside_cpuset_by_type(topology, numa->cpuset, HWLOC_OBJ_CORE);
  if (cores >= sharing * threads) {
    // A contiguous share of the node's cores: share = cores / sharing, thread t on core index*share + t.
    const int share = cores / sharing;
    auto core_pus = [&](int c) {
      return pus_of(topology, hwloc_get_obj_inside_cpuset_by_type(topology, numa->cpuset, HWLOC_OBJ_CORE,
                                                                  static_cast<unsigned>(c))->cpuset);
    };
    for (int c = index * share; c < (index + 1) * share; ++c)
      for (unsigned pu : core_pus(c)) p.share_pus.push_back(pu);
    p.rank_pus = core_pus(index * share);
    for (int w = 0; w < r.workers; ++w) p.worker_pus.push_back(core_pus(index * share + 1 + w));
  } else {
    p.share_pus = p.node_pus;
    p.rank_pus = p.node_pus;
    p.worker_pus.assign(static_cast<std::size_t>(r.workers), p.node_pus);
  }
  return p;
}

PlacementRequest placement_request_from_env(hwloc_topology_t topology, int ranks_on_host, int host_rank,
                                            int workers) {
  PlacementRequest r;
  r.ranks_on_host = ranks_on_host;
  r.host_rank = host_rank;
  r.workers = workers;
  r.enabled = env::get(env::kPlacement) != "none";
  const int num_nodes = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
  if (r.enabled) r.nodes = parse_numa_nodes(env::get(env::kNumaNodes), ranks_on_host, num_nodes);
  return r;
}

void apply_placement(const Placement& placement, const std::vector<unsigned>& pus) noexcept {
  if (!placement.bound || pus.empty()) return;
  hwloc_topology_t topology = host_topology();
  if (topology == nullptr) return warn(Subsys::kInit, "placement: the hwloc topology could not be loaded; not bound");
  hwloc_bitmap_t cpus = bitmap_of(pus);
  if (hwloc_set_cpubind(topology, cpus, HWLOC_CPUBIND_THREAD) != 0)
    warn(Subsys::kInit, "placement: binding the thread to PUs {} failed; running unbound", pu_list(pus));
  // No memory policy is set: Linux's default (local) policy places each page on the node of the
  // CPU that first touches it, and a bound thread touches from its node, falling back to other
  // nodes only when that one is full.
  hwloc_bitmap_free(cpus);
}

namespace {
thread_local std::shared_ptr<const Placement> current_placement;
}

void place_rank_thread(int ranks_on_host, int host_rank) {
  current_placement.reset();
  hwloc_topology_t topology = host_topology();
  if (topology == nullptr) return warn(Subsys::kInit, "placement: the hwloc topology could not be loaded; not bound");
  // A bad MOE_EP_NUM_WORKERS is reported where the workers are sized; the plan then counts none.
  int workers = 0;
  try {
    workers = static_cast<int>(env::get(env::kNumWorkers));
  } catch (const InvalidArgument&) {
  }
  auto placement = std::make_shared<const Placement>(
      plan_placement(topology, placement_request_from_env(topology, ranks_on_host, host_rank, workers)));
  info(Subsys::kInit, "placement: host rank {} of {}: {}", host_rank, ranks_on_host, placement->describe());
  apply_placement(*placement, placement->rank_pus);
  if (placement->bound) current_placement = std::move(placement);
}

std::shared_ptr<const Placement> thread_placement() noexcept { return current_placement; }

void place_worker_thread(const std::shared_ptr<const Placement>& placement, int worker) noexcept {
  if (!placement) return;
  const auto w = static_cast<std::size_t>(worker);
  apply_placement(*placement, w < placement->worker_pus.size() ? placement->worker_pus[w] : placement->share_pus);
  current_placement = placement;
}

hwloc_topology_t host_topology() noexcept {
  static hwloc_topology_t topology = [] {
    hwloc_topology_t t = nullptr;
    if (hwloc_topology_init(&t) != 0) return static_cast<hwloc_topology_t>(nullptr);
    if (hwloc_topology_load(t) != 0) {
      hwloc_topology_destroy(t);
      return static_cast<hwloc_topology_t>(nullptr);
    }
    return t;
  }();
  return topology;
}

}  // namespace moe_ep::core
