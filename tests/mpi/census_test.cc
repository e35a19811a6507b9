// The checks of mpi::make_group's census on answers written here (hosts, builds, pid namespaces
// that a launcher could produce): each refusal names the hosts and the rule, and the same answers
// give the same error on every rank. The exchange itself runs in every group the suite makes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/mpi/census.hh"
#include "moe_ep/error.hpp"
#include "support/text.hh"

namespace moe_ep::testing {
namespace census_test {

using comm::mpi::Census;
using comm::mpi::RankFacts;

// `hosts` hosts named h0, h1, ... with `per_host` ranks each, in blocks; one build, one pid
// namespace per host.
Census census_of(int hosts, int per_host) {
  Census census;
  for (int h = 0; h < hosts; ++h)
    for (int i = 0; i < per_host; ++i) {
      RankFacts f;
      f.version = "1.2.3";
      f.provider_abi = 4;
      f.pid = 100 + h * per_host + i;
      f.pid_namespace = 5000 + static_cast<std::uint64_t>(h);
      f.host_name = fmt::format("h{}", h);  // (not "h" + to_string: a -Wrestrict false positive of GCC 12)
      f.host = h * per_host;
      f.host_size = per_host;
      census.ranks.push_back(f);
    }
  return census;
}

template <class Error, class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(Census, ABuildThatDiffersNamesItsRanksHostsAndVersions) {
  Census census = census_of(2, 2);
  census.ranks[2].version = census.ranks[3].version = "1.3.0";
  const std::string what = error_of<InvalidArgument>([&] { comm::mpi::check_same_build(census, 1); });
  EXPECT_EQ(what,
            "[rank 1] mpi::make_group: ranks disagree on the moe-ep build: moe-ep 1.2.3 (provider ABI 4) on ranks [0, 1], "
            "moe-ep 1.3.0 (provider ABI 4) on ranks [2, 3]; the ranks run on host 'h0' (ranks [0, 1]), host 'h1' "
            "(ranks [2, 3]); every rank of a group must run the same moe-ep version and provider ABI");
}

TEST(Census, AProviderAbiThatDiffersIsRefusedToo) {
  Census census = census_of(2, 1);
  census.ranks[1].provider_abi = 5;
  const std::string what = error_of<InvalidArgument>([&] { comm::mpi::check_same_build(census, 0); });
  EXPECT_TRUE(contains(what, "moe-ep 1.2.3 (provider ABI 4) on rank [0], moe-ep 1.2.3 (provider ABI 5) on rank [1]"))
      << what;
  EXPECT_NO_THROW(comm::mpi::check_same_build(census_of(4, 1), 0));
}

TEST(Census, ANodeAcrossHostsNamesBothHosts) {
  const Census census = census_of(2, 1);
  const std::string what = error_of<InvalidArgument>([&] { comm::mpi::agreed_ranks_per_node(census, 0, 2); });
  EXPECT_TRUE(contains(what, "node 0 (ranks 0..1) spans two hosts: rank 0 runs on host 'h0' (ranks [0]), rank 1 on "
                             "host 'h1' (ranks [1])")) << what;
}

TEST(Census, RanksPerNodeMustDivideEveryHost) {
  // Hosts of 3 ranks in blocks: node 1 (ranks 2..3) spans the two hosts.
  Census blocks = census_of(2, 3);
  std::string what = error_of<InvalidArgument>([&] { comm::mpi::agreed_ranks_per_node(blocks, 4, 2); });
  EXPECT_TRUE(contains(what, "node 1 (ranks 2..3) spans two hosts")) << what;
  // Ranks dealt round-robin (h0 runs ranks 0 and 2, h1 ranks 1 and 3, h2 ranks 4 and 5): node 0
  // spans h0 and h1 as well.
  Census dealt = census_of(3, 2);
  dealt.ranks[1] = census_of(3, 2).ranks[2];
  dealt.ranks[2] = census_of(3, 2).ranks[0];
  what = error_of<InvalidArgument>([&] { comm::mpi::agreed_ranks_per_node(dealt, 0, 2); });
  EXPECT_TRUE(contains(what, "spans two hosts")) << what;
  // One host of 3 ranks beside hosts of 2, ranks per node 0 (a node per host): refused by name.
  Census uneven = census_of(2, 2);
  RankFacts third = uneven.ranks[1];
  third.pid = 999;
  uneven.ranks.insert(uneven.ranks.begin() + 2, third);
  for (auto& f : uneven.ranks) f.host_size = f.host == 0 ? 3 : 2;
  for (int r = 3; r < 5; ++r) uneven.ranks[static_cast<size_t>(r)].host = 3;
  what = error_of<InvalidArgument>([&] { comm::mpi::agreed_ranks_per_node(uneven, 0, 0); });
  EXPECT_TRUE(contains(what, "the hosts run different numbers of ranks (host 'h0' (ranks [0, 1, 2]) runs 3, host "
                             "'h1' (ranks [3, 4]) runs 2)")) << what;
  // The layouts that fit.
  EXPECT_EQ(comm::mpi::agreed_ranks_per_node(census_of(2, 4), 0, 0), 4);
  EXPECT_EQ(comm::mpi::agreed_ranks_per_node(census_of(2, 4), 0, 2), 2);
  EXPECT_EQ(comm::mpi::agreed_ranks_per_node(census_of(4, 1), 0, 0), 1);
}

TEST(Census, RanksThatAskForDifferentNodesAreNamed) {
  Census census = census_of(1, 4);
  census.ranks[3].ranks_per_node = 2;
  try {
    comm::mpi::agreed_ranks_per_node(census, 0, 0);
    ADD_FAILURE() << "no error";
  } catch (const PeerError& e) {
    EXPECT_EQ(std::string(e.what()), "[rank 0] mpi::make_group: ranks disagree on ranks_per_node: 0 on ranks [0, 1, 2], "
                                     "2 on rank [3]");
    EXPECT_EQ(e.ranks(), (std::vector<int>{3}));  // the ranks that hold another value than rank 0
  }
  try {
    comm::mpi::agreed_ranks_per_node(census, 3, 2);
    ADD_FAILURE() << "no error";
  } catch (const PeerError& e) {
    EXPECT_EQ(e.ranks(), (std::vector<int>{0, 1, 2}));  // seen from rank 3, the other side
  }
}

TEST(Census, ANodeInTwoPidNamespacesCannotShareMemory) {
  Census census = census_of(2, 2);
  census.ranks[3].pid_namespace = 7777;
  const std::string what = error_of<InvalidArgument>([&] { comm::mpi::check_nodes_share_memory(census, 0, 2); });
  EXPECT_TRUE(contains(what, "on host 'h1' (ranks [2, 3]), ranks 2 and 3 of node 1 run in different pid namespaces "
                             "(5001 and 7777)")) << what;
  EXPECT_TRUE(contains(what, "the processes of one node must share a pid namespace")) << what;
  // One rank per node needs no shared memory: fine. Unknown namespaces (0) are not trusted.
  EXPECT_NO_THROW(comm::mpi::check_nodes_share_memory(census, 0, 1));
  Census unknown = census_of(1, 2);
  unknown.ranks[0].pid_namespace = unknown.ranks[1].pid_namespace = 0;
  EXPECT_THROW(comm::mpi::check_nodes_share_memory(unknown, 0, 2), InvalidArgument);
}

TEST(Census, PidsAreKeptOnlyWhereLivenessCanBeWatched) {
  Census census = census_of(2, 2);
  census.ranks[1].pid_namespace = 9;  // another container on host h0 (with ranks per node 1)
  const auto info = comm::mpi::host_info(census, 0);
  EXPECT_EQ(info->pids, (std::vector<pid_t>{100, 0, 0, 0}));  // own; other namespace; other host
  EXPECT_EQ(info->host, (std::vector<int>{0, 0, 2, 2}));
  EXPECT_EQ(info->host_size, 2);
}

TEST(Census, RecordsRoundTripAndGarbageIsNamed) {
  const RankFacts f = census_of(2, 2).ranks[3];
  const RankFacts back = comm::mpi::decode(comm::mpi::encode(f), 3, 0);
  EXPECT_EQ(back.version, f.version);
  EXPECT_EQ(back.provider_abi, f.provider_abi);
  EXPECT_EQ(back.pid, f.pid);
  EXPECT_EQ(back.pid_namespace, f.pid_namespace);
  EXPECT_EQ(back.host_name, f.host_name);
  EXPECT_EQ(back.host, f.host);
  EXPECT_EQ(back.host_size, f.host_size);
  const std::string garbage = "\x01\x02not json";
  const std::string what = error_of<StateError>(
      [&] { comm::mpi::decode(std::as_bytes(std::span(garbage.data(), garbage.size())), 2, 0); });
  EXPECT_TRUE(contains(what, "[rank 0] mpi::make_group: rank 2 sent 10 bytes that are not a moe-ep census record"))
      << what;
}

}  // namespace census_test
}  // namespace moe_ep::testing
