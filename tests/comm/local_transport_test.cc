#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "comm/transport.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"

namespace moe_ep::comm {
namespace {

constexpr Wait kWait{"test", 30.0};

std::span<const std::byte> bytes_of(const std::vector<int>& v) { return std::as_bytes(std::span(v)); }

TEST(LocalWorld, AllGatherDeliversEveryBlockOverManyRounds) {
  for (int ranks : {1, 2, 3, 8}) {
    LocalWorld world(ranks);
    world.run([&](Group& g) {
      Transport& t = g.transport();
      for (int round = 0; round < 200; ++round) {
        // Block sizes vary by rank and round, so slot reuse across rounds is exercised.
        std::vector<int> mine(static_cast<size_t>(1 + (g.rank() + round) % 5), g.rank() * 1000 + round);
        Gathered all = t.all_gather(bytes_of(mine), Scope::kWorld, kWait);
        ASSERT_EQ(all.size(), ranks);
        for (int r = 0; r < ranks; ++r) {
          ASSERT_EQ(all[r].size(), sizeof(int) * static_cast<size_t>(1 + (r + round) % 5));
          ASSERT_EQ(all.as<int>(r), r * 1000 + round);
        }
      }
    });
  }
}

TEST(LocalWorld, NodeScopeGathersOnlyTheNode) {
  LocalWorld world(8, {.num_scaleout = 2});
  world.run([&](Group& g) {
    EXPECT_EQ(g.num_scaleup(), 4);
    EXPECT_EQ(g.scaleout_rank(), g.rank() / 4);
    Transport& t = g.transport();
    for (int round = 0; round < 50; ++round) {
      std::vector<int> mine{g.rank(), round};
      Gathered node = t.all_gather(bytes_of(mine), Scope::kNode, kWait);
      ASSERT_EQ(node.size(), 4);
      for (int i = 0; i < 4; ++i) ASSERT_EQ(node.as<int>(i), g.scaleout_rank() * 4 + i);
      if (round % 7 == 0) t.barrier(Scope::kWorld, kWait);  // interleave scopes
    }
  });
}

TEST(LocalWorld, TimeoutNamesTheRankThatDidNotArrive) {
  LocalWorld world(4);
  std::atomic<int> timeouts{0};
  try {
    world.run([&](Group& g) {
      if (g.rank() == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        return;
      }
      try {
        g.transport().barrier(Scope::kWorld, {"unit barrier", 0.2});
      } catch (const TimeoutError& e) {
        EXPECT_EQ(e.ranks(), std::vector<int>{2});
        EXPECT_NE(std::string(e.what()).find("unit barrier"), std::string::npos);
        EXPECT_NE(std::string(e.what()).find("ranks [2]"), std::string::npos);
        ++timeouts;
        throw;
      }
    });
    FAIL() << "expected a timeout";
  } catch (const TimeoutError&) {
  }
  EXPECT_EQ(timeouts, 3);
}

TEST(LocalWorld, DepartedRankIsNamedAtOnceAndRootCauseWins) {
  LocalWorld world(4);
  const auto start = std::chrono::steady_clock::now();
  try {
    world.run([&](Group& g) {
      if (g.rank() == 1) throw InvalidArgument("bad input on rank 1");
      try {
        g.transport().barrier(Scope::kWorld, {"after input", 60.0});
      } catch (const PeerError& e) {
        EXPECT_EQ(e.ranks(), std::vector<int>{1});
        EXPECT_NE(std::string(e.what()).find("bad input on rank 1"), std::string::npos);
        throw;
      }
    });
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "bad input on rank 1");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(LocalWorld, ScaleUpAccessIsRefusedAcrossNodesAndPutSignalWorks) {
  LocalWorld world(4, {.num_scaleout = 2});
  world.run([&](Group& g) {
    Transport& t = g.transport();
    auto mem = t.allocate_symmetric(4096, kWait);
    std::memset(mem->local(), 0, 4096);
    const int same = g.rank() ^ 1, other = (g.rank() + 2) % 4;
    EXPECT_NE(mem->node_peer(same), nullptr);
    EXPECT_THROW(mem->node_peer(other), StateError);
    EXPECT_THROW(t.node_address(other, mem->local()), StateError);
    t.barrier(Scope::kWorld, kWait);
    for (int round = 1; round <= 20; ++round) {
      const int payload = g.rank() * 100 + round;
      t.put(other, *mem, static_cast<size_t>(64 * round), &payload, sizeof payload);
      t.signal(other);
      const int from[] = {other};
      const std::uint64_t target[] = {static_cast<std::uint64_t>(round)};
      t.wait_signals(from, target, kWait);
      int got;
      std::memcpy(&got, mem->local() + 64 * round, sizeof got);
      ASSERT_EQ(got, other * 100 + round);
    }
    EXPECT_THROW(t.put(other, *mem, 4090, &g, 8), StateError);
    t.barrier(Scope::kWorld, kWait);
  });
}

TEST(LocalWorld, DuplicatedChannelsHaveIndependentSequences) {
  LocalWorld world(3);
  world.run([&](Group& g) {
    auto a = g.transport().duplicate(kWait);
    auto b = g.transport().duplicate(kWait);
    // Ranks use the two channels in different orders; each channel still matches up.
    std::vector<int> mine{g.rank()};
    if (g.rank() == 0) {
      auto x = a->all_gather(bytes_of(mine), Scope::kWorld, kWait);
      auto y = b->all_gather(bytes_of(mine), Scope::kWorld, kWait);
      EXPECT_EQ(x.as<int>(2), 2);
      EXPECT_EQ(y.as<int>(1), 1);
    } else {
      std::thread other([&] { b->all_gather(bytes_of(mine), Scope::kWorld, kWait); });
      a->all_gather(bytes_of(mine), Scope::kWorld, kWait);
      other.join();
    }
  });
}

TEST(Topology, RejectsShapesThatDoNotMatch) {
  EXPECT_THROW(LocalWorld(6, {.num_scaleout = 4}), InvalidArgument);
  EXPECT_THROW(LocalWorld(8, {.num_scaleout = 2, .num_scaleup = 3}), InvalidArgument);
  EXPECT_THROW(LocalWorld(0), InvalidArgument);
  EXPECT_EQ(LocalWorld(8, {.num_scaleout = 4}).topology().num_scaleup, 2);
}

}  // namespace
}  // namespace moe_ep::comm
