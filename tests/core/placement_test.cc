// NUMA placement planning on synthetic hwloc topologies, against hand-worked placements: the
// block mapping of ranks to nodes, the core shares, the fall-back to the whole node, one node =
// no binding, the explicit MOE_EP_NUMA_NODES mapping and its errors, refused requests; applying a
// placement, checked against the affinity the OS reports (sched_getaffinity), and this host's plan.
#include "core/placement.hh"

#include <gtest/gtest.h>
#include <sched.h>

#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "moe_ep/env.hpp"
#include "support/errors.hh"
#include "support/temp_dir.hh"

namespace moe_ep::core {
namespace {

using Pus = std::vector<unsigned>;

// A synthetic topology ("pack:2 numa:1 core:4 pu:2" ...), destroyed with the object.
class Synthetic {
 public:
  explicit Synthetic(const char* description) {
    EXPECT_EQ(hwloc_topology_init(&topology_), 0);
    EXPECT_EQ(hwloc_topology_set_synthetic(topology_, description), 0) << description;
    EXPECT_EQ(hwloc_topology_load(topology_), 0);
  }
  ~Synthetic() { hwloc_topology_destroy(topology_); }
  Synthetic(const Synthetic&) = delete;
  Synthetic& operator=(const Synthetic&) = delete;
  hwloc_topology_t get() const { return topology_; }

 private:
  hwloc_topology_t topology_ = nullptr;
};

Placement plan(const Synthetic& t, int ranks, int rank, int workers, std::vector<int> nodes = {}) {
  PlacementRequest r;
  r.ranks_on_host = ranks;
  r.host_rank = rank;
  r.workers = workers;
  r.nodes = std::move(nodes);
  return plan_placement(t.get(), r);
}

// Two nodes of 4 cores of 2 PUs: node 0 = PUs 0-7 (core c = PUs 2c, 2c+1), node 1 = PUs 8-15.
constexpr const char* kTwoNodes = "pack:2 numa:1 core:4 pu:2";

TEST(Placement, EightRanksOnTwoNodesGetOneCoreEach) {
  Synthetic t(kTwoNodes);
  const std::vector<int> node = {0, 0, 0, 0, 1, 1, 1, 1};
  const std::vector<Pus> pus = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}};
  for (int i = 0; i < 8; ++i) {
    const Placement p = plan(t, 8, i, 0);
    ASSERT_TRUE(p.bound) << i;
    EXPECT_EQ(p.numa_node, node[i]) << i;
    EXPECT_EQ(p.rank_pus, pus[i]) << i;
    EXPECT_TRUE(p.worker_pus.empty());
    EXPECT_EQ(p.node_pus.size(), 8u);
  }
}

TEST(Placement, ThreeRanksOnTwoNodesShareInBlocks) {
  // Rank i on node floor(2i/3): 0, 0, 1. Ranks 0 and 1 halve node 0 (2 cores each: the rank
  // thread on the first, the worker on the second); rank 2 has node 1 to itself (share 4 cores).
  Synthetic t(kTwoNodes);
  const Placement p0 = plan(t, 3, 0, 1), p1 = plan(t, 3, 1, 1), p2 = plan(t, 3, 2, 1);
  EXPECT_EQ(p0.numa_node, 0);
  EXPECT_EQ(p0.rank_pus, (Pus{0, 1}));
  EXPECT_EQ(p0.worker_pus, (std::vector<Pus>{{2, 3}}));
  EXPECT_EQ(p1.numa_node, 0);
  EXPECT_EQ(p1.rank_pus, (Pus{4, 5}));
  EXPECT_EQ(p1.worker_pus, (std::vector<Pus>{{6, 7}}));
  EXPECT_EQ(p2.numa_node, 1);
  EXPECT_EQ(p2.rank_pus, (Pus{8, 9}));
  EXPECT_EQ(p2.worker_pus, (std::vector<Pus>{{10, 11}}));
  // The shares: workers beyond the planned ones run on them.
  EXPECT_EQ(p0.share_pus, (Pus{0, 1, 2, 3}));
  EXPECT_EQ(p1.share_pus, (Pus{4, 5, 6, 7}));
  EXPECT_EQ(p2.share_pus, (Pus{8, 9, 10, 11, 12, 13, 14, 15}));
}

TEST(Placement, TooFewCoresFallsBackToTheWholeNode) {
  // 4 ranks per node with a worker each need 8 cores; the node has 4.
  Synthetic t(kTwoNodes);
  const Placement p = plan(t, 8, 5, 1);
  EXPECT_EQ(p.numa_node, 1);
  const Pus node1 = {8, 9, 10, 11, 12, 13, 14, 15};
  EXPECT_EQ(p.rank_pus, node1);
  EXPECT_EQ(p.share_pus, node1);
  EXPECT_EQ(p.worker_pus, (std::vector<Pus>{node1}));
}

TEST(Placement, FourNodesTwoRanks) {
  // "numa:4 core:2 pu:1": node n = PUs 2n, 2n+1. Ranks on nodes floor(4i/2) = 0 and 2.
  Synthetic t("numa:4 core:2 pu:1");
  const Placement p1 = plan(t, 2, 1, 1);
  EXPECT_EQ(p1.numa_node, 2);
  EXPECT_EQ(p1.rank_pus, (Pus{4}));
  EXPECT_EQ(p1.worker_pus, (std::vector<Pus>{{5}}));
  EXPECT_EQ(plan(t, 2, 0, 1).numa_node, 0);
}

TEST(Placement, OneNumaNodeBindsNothing) {
  Synthetic t("core:8 pu:1");
  const Placement p = plan(t, 4, 2, 1);
  EXPECT_FALSE(p.bound);
  EXPECT_TRUE(p.rank_pus.empty());
  EXPECT_EQ(p.describe(), "none");
}

TEST(Placement, ExplicitNodesReplaceTheBlocks) {
  Synthetic t(kTwoNodes);
  const Placement p = plan(t, 2, 0, 0, parse_numa_nodes("1,0", 2, 2));
  EXPECT_EQ(p.numa_node, 1);
  EXPECT_EQ(p.rank_pus, (Pus{8, 9}));
  // Both on node 0: halves of it.
  EXPECT_EQ(plan(t, 2, 1, 0, parse_numa_nodes("0,0", 2, 2)).rank_pus, (Pus{4, 5}));
}

TEST(Placement, FromEnvironment) {
  Synthetic t(kTwoNodes);
  {
    env::ScopedOverride nodes("MOE_EP_NUMA_NODES", "1,1");
    const Placement p = plan_placement(t.get(), placement_request_from_env(t.get(), 2, 0, 0));
    EXPECT_EQ(p.numa_node, 1);
    EXPECT_EQ(p.rank_pus, (Pus{8, 9}));
  }
  env::ScopedOverride none("MOE_EP_PLACEMENT", "none");
  EXPECT_FALSE(plan_placement(t.get(), placement_request_from_env(t.get(), 2, 0, 0)).bound);
}

TEST(Placement, BadNumaNodesAreInvalidArguments) {
  auto check = [](const char* text, const char* part) {
    const testing::Caught c = testing::catch_error([&] { parse_numa_nodes(text, 2, 2); });
    EXPECT_EQ(c.type, "InvalidArgument") << text;
    EXPECT_NE(c.message.find("MOE_EP_NUMA_NODES"), std::string::npos) << c.message;
    EXPECT_NE(c.message.find(text), std::string::npos) << c.message;
    EXPECT_NE(c.message.find(part), std::string::npos) << c.message;
  };
  check("0,2", "0 to 1");        // out of range
  check("0,-1", "0 to 1");
  check("0", "has 2 ranks");     // wrong count
  check("0,1,1", "has 2 ranks");
  check("0,x", "\"x\" is not");  // not a number
  check("0,,1", "\"\" is not");
  EXPECT_TRUE(parse_numa_nodes("", 2, 2).empty());
}

TEST(Placement, RefusedRequestsAreInvalidArguments) {
  Synthetic t(kTwoNodes);
  const testing::Caught outside = testing::catch_error([&] { plan(t, 2, 2, 0); });
  EXPECT_EQ(outside.type, "InvalidArgument");
  EXPECT_NE(outside.message.find("host_rank 2 is outside [0, ranks_on_host 2)"), std::string::npos) << outside.message;
  const testing::Caught negative = testing::catch_error([&] { plan(t, 2, -1, 0); });
  EXPECT_EQ(negative.type, "InvalidArgument");
  const testing::Caught short_mapping = testing::catch_error([&] { plan(t, 2, 0, 0, {1}); });
  EXPECT_EQ(short_mapping.type, "InvalidArgument");
  EXPECT_NE(short_mapping.message.find("1 NUMA nodes given for 2 ranks"), std::string::npos) << short_mapping.message;
  const testing::Caught bad_node = testing::catch_error([&] { plan(t, 2, 0, 0, {2, 0}); });
  EXPECT_EQ(bad_node.type, "InvalidArgument");
  EXPECT_NE(bad_node.message.find("NUMA node 2 is outside [0, 2)"), std::string::npos) << bad_node.message;
}

// The CPUs the calling thread may run on, as the OS reports them (sched_getaffinity of the thread).
Pus thread_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  Pus cpus;
  for (unsigned c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

void set_thread_cpus(const Pus& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (unsigned c : cpus) CPU_SET(c, &set);
  ASSERT_EQ(sched_setaffinity(0, sizeof set, &set), 0);
}

// A bound placement whose node, share and rank PUs are all of `node`: apply_placement binds to the
// PUs it is given, not to these.
Placement bound_on(const Pus& node) {
  Placement p;
  p.bound = true;
  p.numa_node = 0;
  p.node_pus = p.share_pus = p.rank_pus = node;
  return p;
}

// Each check runs on a thread of its own, whose affinity starts as the process's and ends with it.
TEST(Placement, ApplyingBindsTheCallingThreadToThePus) {
  const Pus allowed = thread_cpus();
  if (allowed.size() < 2) GTEST_SKIP() << "this process may run on one CPU only: a binding would not be visible";
  const Pus one = {allowed.back()}, two = {allowed.front(), allowed.back()};
  Pus after_one, after_two;
  std::thread([&] {
    apply_placement(bound_on(allowed), one);
    after_one = thread_cpus();
    apply_placement(bound_on(allowed), two);
    after_two = thread_cpus();
  }).join();
  EXPECT_EQ(after_one, one);
  EXPECT_EQ(after_two, two);
  EXPECT_EQ(thread_cpus(), allowed);  // only the calling thread was bound
}

// Runs f on a new thread with WARN lines logged to a file; returns what was logged.
template <class F>
std::string warnings_of(F f) {
  testing::TempDir dir("moe-ep-placement");
  const std::string log = dir.file("log");
  {
    env::ScopedOverride level("MOE_EP_DEBUG", "WARN");
    env::ScopedOverride file("MOE_EP_DEBUG_FILE", log);
    std::thread(f).join();
  }
  std::ifstream in(log);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(Placement, UnboundPlacementsAndEmptyListsBindNothing) {
  // No-ops (placement.hh): the thread keeps its CPUs and nothing is logged.
  const Pus allowed = thread_cpus();
  if (allowed.size() < 2) GTEST_SKIP() << "this process may run on one CPU only: a binding would not be visible";
  const Pus start = {allowed.back()}, other = {allowed.front()};
  Pus after_unbound, after_empty;
  const std::string log = warnings_of([&] {
    set_thread_cpus(start);
    apply_placement(Placement{}, other);  // bound = false: "none"
    after_unbound = thread_cpus();
    apply_placement(bound_on(other), {});
    after_empty = thread_cpus();
  });
  EXPECT_EQ(after_unbound, start);
  EXPECT_EQ(after_empty, start);
  EXPECT_EQ(log.find("placement"), std::string::npos) << log;
}

TEST(Placement, AFailedBindingWarnsAndKeepsTheAffinity) {
  // A PU this machine does not have: hwloc refuses the binding; the thread keeps its CPUs and a
  // warning names the PUs.
  const Pus allowed = thread_cpus();
  const Pus missing = {allowed.back() + 4096};
  Pus after;
  const std::string log = warnings_of([&] {
    apply_placement(bound_on(allowed), missing);
    after = thread_cpus();
  });
  EXPECT_EQ(after, allowed);
  EXPECT_NE(log.find("WARN INIT placement: binding the thread to PUs " + std::to_string(missing[0]) + " failed"),
            std::string::npos)
      << log;
}

TEST(Placement, ThisHostBindsOnlyWithSeveralNumaNodes) {
  // The plan of one rank on this host: bound to a node's PUs exactly when hwloc sees more than one
  // NUMA node (docs/performance.md), else "none".
  hwloc_topology_t host = host_topology();
  ASSERT_NE(host, nullptr);
  const Placement p = plan_placement(host, PlacementRequest{});
  if (hwloc_get_nbobjs_by_type(host, HWLOC_OBJ_NUMANODE) <= 1) {
    EXPECT_FALSE(p.bound);
    EXPECT_TRUE(p.rank_pus.empty());
    EXPECT_EQ(p.describe(), "none");
  } else {
    EXPECT_TRUE(p.bound);
    EXPECT_EQ(p.numa_node, 0);
    EXPECT_FALSE(p.rank_pus.empty());
  }
}

}  // namespace
}  // namespace moe_ep::core
