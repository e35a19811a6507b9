#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include <fmt/format.h>

#include <limits>

#include "comm/transport.hh"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"
#include "support/env_scope.hh"
#include "support/errors.hh"

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

// Timeout tests are independent of the machine's load: one rank waits, and every other rank
// stays in the group, away from the wait, until that rank is done (it waits for it, not for a
// clock), so no rank that is there can be late.
// Runs `wait` on rank `waiter` only, after `before` ran on every rank.
void wait_alone(LocalWorld& world, int waiter, const std::function<void(Group&)>& wait,
                const std::function<void(Group&)>& before = {}) {
  std::atomic<bool> done{false};
  world.run([&](Group& g) {
    if (before) before(g);
    if (g.rank() == waiter) {
      wait(g);
      done = true;
      return;
    }
    while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  });
}

TEST(LocalWorld, TimeoutNamesTheRanksThatDidNotArrive) {
  LocalWorld world(4);
  wait_alone(world, 0, [](Group& g) {
    try {
      g.transport().barrier(Scope::kWorld, {"unit barrier", 0.2});
      ADD_FAILURE() << "expected a timeout";
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.ranks(), (std::vector<int>{1, 2, 3}));
      EXPECT_NE(std::string(e.what()).find("[rank 0] unit barrier: timed out after"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("(timeout 0.2 s) waiting for ranks [1, 2, 3]"), std::string::npos) << e.what();
    }
    // The timed-out rank left the channel: the ranks are out of step.
    try {
      g.transport().barrier(Scope::kWorld, {"next barrier", 0.2});
      ADD_FAILURE() << "expected a refusal";
    } catch (const StateError& e) {
      EXPECT_NE(std::string(e.what()).find("this rank left the channel after a failure"), std::string::npos) << e.what();
    }
  });
}

TEST(LocalWorld, ANodeScopeTimeoutOnTheSecondNodeNamesGlobalRanks) {
  LocalWorld world(4, {.num_scaleout = 2});
  wait_alone(world, 2, [](Group& g) {
    try {
      g.transport().barrier(Scope::kNode, {"node barrier", 0.2});
      ADD_FAILURE() << "expected a timeout";
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.ranks(), std::vector<int>{3});  // rank 3, not its index 1 on node 1
      EXPECT_NE(std::string(e.what()).find("[rank 2] node barrier: timed out after"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("waiting for ranks [3]"), std::string::npos) << e.what();
    }
  });
}

TEST(LocalWorld, AScaleOutSignalTimeoutNamesThePeers) {
  // Rank 1 (node 0) waits for signals of ranks 2 and 3 (node 1): neither signals.
  const int from[] = {2, 3};
  const std::uint64_t target[] = {1, 1};
  LocalWorld world(4, {.num_scaleout = 2});
  wait_alone(world, 1, [&](Group& g) {
    try {
      g.transport().wait_signals(from, target, {"records of other nodes", 0.2});
      ADD_FAILURE() << "expected a timeout";
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.ranks(), (std::vector<int>{2, 3}));
      EXPECT_NE(std::string(e.what()).find("[rank 1] records of other nodes: timed out after"), std::string::npos)
          << e.what();
    }
  });
  // Rank 3 signals before rank 1 waits: only rank 2 is named.
  LocalWorld again(4, {.num_scaleout = 2});
  wait_alone(
      again, 1,
      [&](Group& g) {
        try {
          g.transport().wait_signals(from, target, {"records of other nodes", 0.2});
          ADD_FAILURE() << "expected a timeout";
        } catch (const TimeoutError& e) {
          EXPECT_EQ(e.ranks(), std::vector<int>{2}) << e.what();
        }
      },
      [](Group& g) {
        if (g.rank() == 3) g.transport().signal(1);
        g.transport().barrier(Scope::kWorld, kWait);  // the signal was sent before rank 1 waits
      });
}

// A rank that gives up because another one left names that one: the root cause travels.
TEST(LocalWorld, ARankThatGaveUpBecauseOfAnotherNamesTheRootCause) {
  LocalWorld world(4, {.num_scaleout = 2});
  std::atomic<bool> done{false};
  std::vector<std::string> messages(4);
  std::vector<std::vector<int>> named(4);
  world.run([&](Group& g) {
    Transport& t = g.transport();
    auto ch = t.duplicate(kWait);
    const int r = g.rank();
    try {
      if (r == 1) {
        ch->abandon("[rank 1] its work failed", {});
      } else if (r == 0) {
        ch->barrier(Scope::kNode, {"node barrier", 30});  // waits for rank 1, which gave up
      } else {
        const int from[] = {0};  // node 1 waits for records of rank 0, which never come
        const std::uint64_t target[] = {1};
        ch->wait_signals(from, target, {"records of node 0", 30});
      }
    } catch (const PeerError& e) {
      messages[static_cast<size_t>(r)] = e.what();
      named[static_cast<size_t>(r)] = e.ranks();
    }
    if (r == 0) done = true;
    while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  });
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(named[static_cast<size_t>(r)], std::vector<int>{1}) << messages[static_cast<size_t>(r)];
    EXPECT_NE(messages[static_cast<size_t>(r)].find("[rank 1] its work failed"), std::string::npos)
        << messages[static_cast<size_t>(r)];
  }
  EXPECT_NE(messages[2].find("rank 0 gave up on this channel"), std::string::npos) << messages[2];
}

TEST(LocalWorld, TimeoutsTooLargeForTheClockNeverExpire) {
  for (double timeout : {1e10, 1e300}) {
    LocalWorld world(2);
    world.run([&](Group& g) {
      if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      g.transport().barrier(Scope::kWorld, {"patient barrier", timeout});  // arrives late: no timeout
      g.barrier(timeout);
    });
  }
}

TEST(LocalWorld, InfiniteAndNonPositiveTimeoutsAreRefused) {
  LocalWorld(1).run([&](Group& g) {
    for (double bad : {std::numeric_limits<double>::infinity(), -1.0, std::numeric_limits<double>::quiet_NaN()}) {
      try {
        g.barrier(bad);
        ADD_FAILURE() << bad;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("[rank 0] Group::barrier: timeout_secs = "), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("expected a positive, finite number of seconds"), std::string::npos)
            << e.what();
      }
    }
    // MOE_EP_TIMEOUT_SECS follows the same rule: the registry refuses such values (an override when
    // it is made, the environment below when a barrier reads it).
    for (const char* bad : {"inf", "0"}) EXPECT_THROW(env::ScopedOverride("MOE_EP_TIMEOUT_SECS", bad), InvalidArgument);
    env::ScopedOverride huge("MOE_EP_TIMEOUT_SECS", "1e300");
    g.barrier();  // saturated: never expires, and a present group passes at once
  });
  for (const char* bad : {"inf", "0"}) {
    testing::ScopedEnvironment set("MOE_EP_TIMEOUT_SECS", bad);
    const std::string m = testing::error_of([] { LocalWorld(1).run([](Group& g) { g.barrier(); }); });
    EXPECT_NE(m.find(fmt::format("MOE_EP_TIMEOUT_SECS=\"{}\" is invalid: accepted values are a positive, finite number",
                                 bad)),
              std::string::npos)
        << m;
  }
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
