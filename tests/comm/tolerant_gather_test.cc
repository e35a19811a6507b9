// comm::TolerantGather (src/comm/tolerant_gather.hh) on in-process ranks: every block arrives
// over many rounds; a rank that left, one whose thread is gone, one in another call and one that
// arrives after the others gave up on it are dropped, with the survivors agreeing among themselves
// (the late rank learns it was dropped and goes on alone); leave() reports whether every peer left.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "comm/tolerant_gather.hh"
#include "comm/transport.hh"
#include "moe_ep/group.hpp"

namespace moe_ep::comm {
namespace tolerant_gather_test {

constexpr Wait kSetup{"tolerant gather test", 30.0};

std::vector<std::byte> block_of(int rank, int round) {
  std::vector<std::byte> b(static_cast<size_t>(4 + (rank * 7 + round) % 300));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>((rank * 31 + round * 5 + i) & 0xff);
  return b;
}

std::vector<char> all_of(int ranks) { return std::vector<char>(static_cast<size_t>(ranks), 1); }

std::vector<char> except(int ranks, std::initializer_list<int> gone) {
  std::vector<char> live = all_of(ranks);
  for (int r : gone) live[static_cast<size_t>(r)] = 0;
  return live;
}

// The members of a result as a list of ranks.
std::vector<int> members_of(const TolerantGather::Result& r) {
  std::vector<int> m;
  for (std::size_t i = 0; i < r.member.size(); ++i)
    if (r.member[i]) m.push_back(static_cast<int>(i));
  return m;
}

TEST(TolerantGather, EveryBlockArrivesOverManyRoundsAndEveryRankLeaves) {
  for (int ranks : {1, 2, 5}) {
    LocalWorld(ranks).run([&](Group& g) {
      TolerantGather gather(g.transport(), 4096, kSetup);
      for (int round = 0; round < 60; ++round) {
        const TolerantGather::Result r = gather.gather(block_of(g.rank(), round), "call", all_of(ranks), 30);
        ASSERT_EQ(r.member, all_of(ranks)) << "round " << round;
        for (int p = 0; p < ranks; ++p) {
          ASSERT_EQ(r.blocks[static_cast<size_t>(p)], block_of(p, round)) << "round " << round << ", rank " << p;
          ASSERT_EQ(r.dropped[static_cast<size_t>(p)], "");
        }
      }
      EXPECT_TRUE(gather.leave(30));
    });
  }
}

TEST(TolerantGather, RanksThatLeaveOrAreGoneOrInAnotherCallAreDropped) {
  constexpr int kRanks = 5;
  LocalWorld(kRanks).run([&](Group& g) {
    const int me = g.rank();
    auto gather = std::make_unique<TolerantGather>(g.transport(), 4096, kSetup);
    if (me == 4) return;  // gone: its thread returns without a word (the gather keeps its memory)
    gather->gather(block_of(me, 0), "call", all_of(kRanks), 30);  // rank 4 may be there or not yet
    if (me == 1) {
      EXPECT_TRUE(gather->leave(30));  // waits for the others to leave too
      return;
    }
    // Rank 3 makes another call than ranks 0 and 2.
    const TolerantGather::Result r = gather->gather(block_of(me, 1), me == 3 ? "other call" : "call", except(kRanks, {}), 30);
    if (me == 3) {
      EXPECT_EQ(members_of(r), std::vector<int>{3});
      EXPECT_NE(r.dropped[0].find("rank 0 is in another call (call"), std::string::npos) << r.dropped[0];
    } else {
      EXPECT_EQ(members_of(r), (std::vector<int>{0, 2}));
      EXPECT_NE(r.dropped[1].find("rank 1 left the exchange"), std::string::npos) << r.dropped[1];
      EXPECT_NE(r.dropped[3].find("rank 3 is in another call (other call"), std::string::npos) << r.dropped[3];
      EXPECT_NE(r.dropped[4].find("rank 4 left the group"), std::string::npos) << r.dropped[4];
      EXPECT_EQ(r.blocks[static_cast<size_t>(me == 0 ? 2 : 0)], block_of(me == 0 ? 2 : 0, 1));
      // The next call waits only for the members.
      const TolerantGather::Result next = gather->gather(block_of(me, 2), "call", r.member, 30);
      EXPECT_EQ(members_of(next), (std::vector<int>{0, 2}));
    }
    EXPECT_TRUE(gather->leave(30));
  });
}

TEST(TolerantGather, ARankArrivingAfterTheOthersGaveUpGoesOnAlone) {
  constexpr int kRanks = 4;
  std::atomic<int> finished{0};
  LocalWorld(kRanks).run([&](Group& g) {
    const int me = g.rank();
    TolerantGather gather(g.transport(), 4096, kSetup);
    if (me == 3)  // late: it calls only once the others are through the call without it
      while (finished.load() < kRanks - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const TolerantGather::Result r = gather.gather(block_of(me, 0), "call", all_of(kRanks), 1.0);
    if (me == 3) {
      EXPECT_EQ(members_of(r), std::vector<int>{3});
      EXPECT_NE(r.dropped[0].find("rank 0 stopped counting on this rank"), std::string::npos) << r.dropped[0];
    } else {
      EXPECT_EQ(members_of(r), (std::vector<int>{0, 1, 2}));
      EXPECT_NE(r.dropped[3].find("rank 3 did not arrive within 1 s"), std::string::npos) << r.dropped[3];
      finished.fetch_add(1);
    }
    // The survivors' next call and the late rank's own go on without each other.
    const TolerantGather::Result next = gather.gather(block_of(me, 1), "call", r.member, 1.0);
    EXPECT_EQ(next.member, r.member);
    EXPECT_TRUE(gather.leave(30));
  });
}

TEST(TolerantGather, LeaveReportsAPeerThatDoesNotLeave) {
  std::atomic<bool> first_left{false};
  LocalWorld(2).run([&](Group& g) {
    TolerantGather gather(g.transport(), 64, kSetup);
    if (g.rank() == 0) {
      EXPECT_FALSE(gather.leave(0.5));  // rank 1 leaves only afterwards
      first_left = true;
    } else {
      while (!first_left.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      EXPECT_TRUE(gather.leave(30));
    }
    EXPECT_THROW(gather.gather({}, "call", all_of(2), 1.0), StateError);
  });
}

}  // namespace tolerant_gather_test
}  // namespace moe_ep::comm
