// Group's public collectives and facts (moe_ep/group.hpp), on ranks as threads: all_gather returns
// every rank's bytes by rank, whatever their lengths, and names its label when refusing a timeout;
// a duplicate is a group of the same ranks whose collectives pair among themselves; the facts of a
// LocalWorld (every rank on this host, nothing sent between nodes or copied for node peers).
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"
#include "support/errors.hh"

namespace moe_ep {
namespace {

// Rank r's block: r + 1 bytes of value 10 * salt + r.
std::vector<std::byte> block_of(int rank, int salt) {
  return std::vector<std::byte>(static_cast<std::size_t>(rank + 1), static_cast<std::byte>(10 * salt + rank));
}

void expect_blocks(const std::vector<std::vector<std::byte>>& got, int ranks, int salt) {
  ASSERT_EQ(static_cast<int>(got.size()), ranks);
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(got[static_cast<std::size_t>(r)], block_of(r, salt)) << "rank " << r;
}

TEST(Group, AllGatherReturnsEveryRanksBytesByRank) {
  LocalWorld(3).run([](Group& g) {
    expect_blocks(g.all_gather(block_of(g.rank(), 1)), 3, 1);
    expect_blocks(g.all_gather(block_of(g.rank(), 2), 30.0, "second round"), 3, 2);
  });
}

TEST(Group, AllGatherNamesItsLabelWhenRefusingATimeout) {
  LocalWorld(1).run([](Group& g) {
    const testing::Caught c = testing::catch_error([&] { g.all_gather({}, -1.0, "Group.all_gather_bytes"); });
    EXPECT_EQ(c.type, "InvalidArgument");
    EXPECT_EQ(c.message.rfind("Group.all_gather_bytes: timeout_secs = -1 is not a valid timeout", 0), 0u) << c.message;
  });
}

TEST(Group, ADuplicatePairsItsCollectivesAmongThemselves) {
  LocalWorld(2).run([](Group& g) {
    const std::shared_ptr<Group> dup = g.duplicate();
    EXPECT_EQ(dup->rank(), g.rank());
    EXPECT_EQ(dup->size(), g.size());
    // The two groups' rounds interleave; each returns its own ranks' blocks of that round.
    expect_blocks(dup->all_gather(block_of(g.rank(), 3)), 2, 3);
    expect_blocks(g.all_gather(block_of(g.rank(), 4)), 2, 4);
    expect_blocks(dup->all_gather(block_of(g.rank(), 5)), 2, 5);
  });
}

TEST(Group, FactsOfRanksAsThreads) {
  LocalWorld(4, Topology{2, 2}).run([](Group& g) {
    EXPECT_EQ(g.ranks_on_host(), 4);
    g.barrier();
    EXPECT_EQ(g.shared_bytes_copied(), 0u);  // every rank reads its peers' memory in place
  });
}

}  // namespace
}  // namespace moe_ep
