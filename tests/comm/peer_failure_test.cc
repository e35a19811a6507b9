// The errors every transport raises for peers (src/comm/peer_failure.hh), on failures described
// here: the ranks they name are the root cause (the end of a chain of waits, the culprits of a
// member that gave up), never a live rank in the middle.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/peer_failure.hh"
#include "comm/transport.hh"
#include "moe_ep/error.hpp"
#include "support/text.hh"

namespace moe_ep::testing {
namespace peer_failure_test {

const comm::Wait kWait{"dispatch: scale-out records", 5};

// What fail_wait_chain throws when this rank (0) waited for `missing` and the others said whom they
// wait for (`chains`).
TimeoutError chain_error(const std::vector<int>& missing, const std::map<int, std::vector<int>>& chains) {
  try {
    comm::fail_wait_chain(0, kWait, missing, 5.0, [&](int r) -> const std::vector<int>* {
      const auto it = chains.find(r);
      return it == chains.end() ? nullptr : &it->second;
    });
  } catch (const TimeoutError& e) {
    return e;
  }
  ADD_FAILURE() << "fail_wait_chain returned";
  return TimeoutError("", {});
}

TEST(PeerFailure, AnExpiredWaitWithoutChainsNamesTheRanksItWaitedFor) {
  const TimeoutError e = chain_error({2, 3}, {});
  EXPECT_EQ(e.ranks(), (std::vector<int>{2, 3}));
  EXPECT_EQ(std::string(e.what()),
            "[rank 0] dispatch: scale-out records: timed out after 5.0 s (timeout 5 s) waiting for ranks [2, 3]");
}

TEST(PeerFailure, AChainIsFollowedToTheRankThatWaitsForNobody) {
  // 0 waits for 2, 2 waits for 3, 3 waits for 1 (stopped): 1 is at fault.
  const TimeoutError e = chain_error({2}, {{2, {3}}, {3, {1}}});
  EXPECT_EQ(e.ranks(), std::vector<int>{1});
  EXPECT_TRUE(contains(e.what(), "waiting for ranks [2]; rank 2 waits for ranks [3]; rank 3 waits for ranks [1]"))
      << e.what();
}

TEST(PeerFailure, ChainsThatMeetOrGoRoundNameOnlyTheirEnds) {
  // 3 waits for 1 (stopped) and for 2, which waits for 1 too: 1 alone is at fault, whichever
  // chain reaches it first.
  const TimeoutError met = chain_error({1, 3}, {{3, {1, 2}}, {2, {1}}});
  EXPECT_EQ(met.ranks(), std::vector<int>{1}) << met.what();
  const TimeoutError met_other_order = chain_error({3, 1}, {{3, {2, 1}}, {2, {1}}});
  EXPECT_EQ(met_other_order.ranks(), std::vector<int>{1}) << met_other_order.what();
  // 2 waits for this rank (0) alone: it waits for nobody else, so it is the end.
  EXPECT_EQ(chain_error({2}, {{2, {0}}}).ranks(), std::vector<int>{2});
  // 2 and 3 wait for each other (and 2 for this rank): no end, both are named.
  const TimeoutError round = chain_error({2}, {{2, {0, 3}}, {3, {2}}});
  EXPECT_EQ(round.ranks(), (std::vector<int>{2, 3})) << round.what();
  // Two chains with two ends, and a rank that waits for nobody beside them.
  const TimeoutError two = chain_error({1, 2, 5}, {{1, {4}}, {2, {6}}});
  EXPECT_EQ(two.ranks(), (std::vector<int>{4, 5, 6}));
}

TEST(PeerFailure, AWaitEndedByAMemberThatGaveUpNamesItsCulprits) {
  std::vector<std::pair<int, comm::Departure>> departed;
  departed.emplace_back(0, comm::gave_up("[rank 0] agreement: ranks [1] left the group", {1}));
  try {
    comm::fail_channel_left(2, kWait, {1}, departed);
    ADD_FAILURE() << "fail_channel_left returned";
  } catch (const TimeoutError&) {
    ADD_FAILURE() << "a member that gave up is not a timeout";
  } catch (const PeerError& e) {
    EXPECT_EQ(e.ranks(), std::vector<int>{1});
    EXPECT_EQ(std::string(e.what()),
              "[rank 2] dispatch: scale-out records: ranks [0] gave up on this channel while this rank waited for "
              "ranks [1]; rank 0 gave up on this channel: [rank 0] agreement: ranks [1] left the group");
  }
  // A member that gave up on its own account (no culprits, or only this rank) is itself named.
  departed.clear();
  departed.emplace_back(3, comm::gave_up("its input was invalid", {2}));
  try {
    comm::fail_channel_left(2, kWait, {1}, departed);
  } catch (const PeerError& e) {
    EXPECT_EQ(e.ranks(), std::vector<int>{3});
  }
}

}  // namespace peer_failure_test
}  // namespace moe_ep::testing
