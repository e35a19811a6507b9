// The text of a list of ranks and of a disagreement (src/comm/disagreement.hh), on values written
// here: every expected message and blame is written out by hand from the rule in the header
// (values in the byte order of their text, each with the ranks holding it; the blamed ranks are
// those holding a value other than this rank's).
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/disagreement.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::testing {
namespace disagreement_test {

TEST(RankList, OneRankIsSingularSeveralArePlural) {
  EXPECT_EQ(comm::rank_list({3}), "rank [3]");
  EXPECT_EQ(comm::rank_list({0, 2, 5}), "ranks [0, 2, 5]");
  EXPECT_EQ(comm::rank_list({7, 1}), "ranks [7, 1]");  // in the order given
  EXPECT_EQ(comm::rank_list({}), "ranks []");
}

TEST(Disagreement, OneValueEverywhereIsNoDisagreement) {
  EXPECT_FALSE(comm::disagreement("[rank 0] dispatch", "hidden", {{0, "128"}, {1, "128"}, {2, "128"}}, 0));
  EXPECT_FALSE(comm::disagreement("[rank 0] dispatch", "hidden", {{0, "128"}}, 0));
  EXPECT_FALSE(comm::disagreement("[rank 0] dispatch", "hidden", {}, 0));
}

// `e` is the disagreement `message`, naming `ranks`.
void expect_error(const std::optional<PeerError>& e, const std::string& message, const std::vector<int>& ranks) {
  ASSERT_TRUE(e.has_value()) << "no disagreement; expected: " << message;
  EXPECT_EQ(std::string(e->what()), message);
  EXPECT_EQ(e->ranks(), ranks) << message;
}

TEST(Disagreement, TwoValuesNameEachOtherSide) {
  const std::map<int, std::string> held{{0, "8"}, {1, "8"}, {2, "16"}, {3, "16"}};
  expect_error(comm::disagreement("[rank 0] dispatch", "num_max_tokens_per_rank", held, 0),
               "[rank 0] dispatch: ranks disagree on num_max_tokens_per_rank: 16 on ranks [2, 3], 8 on ranks [0, 1]",
               {2, 3});
  expect_error(comm::disagreement("[rank 3] dispatch", "num_max_tokens_per_rank", held, 3),
               "[rank 3] dispatch: ranks disagree on num_max_tokens_per_rank: 16 on ranks [2, 3], 8 on ranks [0, 1]",
               {0, 1});
}

TEST(Disagreement, ThreeValuesBlameEveryRankOfTheOtherTwo) {
  const std::map<int, std::string> held{{0, "bfloat16"}, {1, "float8_e4m3fn"}, {2, "bfloat16"}, {3, "float32"},
                                        {4, "float8_e4m3fn"}};
  expect_error(comm::disagreement("[rank 1] combine", "x dtype", held, 1),
               "[rank 1] combine: ranks disagree on x dtype: bfloat16 on ranks [0, 2], float32 on rank [3], "
               "float8_e4m3fn on ranks [1, 4]",
               {0, 2, 3});
}

TEST(Disagreement, ATieIsJudgedFromEachRanksOwnValue) {
  // Two ranks each: no side is the larger one, and each side names the other.
  const std::map<int, std::string> held{{0, "barrier"}, {1, "dispatch"}, {2, "dispatch"}, {3, "barrier"}};
  const std::string message = "ctx: ranks disagree on the operation: barrier on ranks [0, 3], dispatch on ranks [1, 2]";
  expect_error(comm::disagreement("ctx", "the operation", held, 1), message, {0, 3});
  expect_error(comm::disagreement("ctx", "the operation", held, 0), message, {1, 2});
}

TEST(Disagreement, OneOddRankIsNamedByTheOthersAndNamesThemAll) {
  const std::map<int, std::string> held{{0, "16"}, {1, "16"}, {2, "16"}, {3, "32"}};
  const std::string message = "ctx: ranks disagree on num_experts: 16 on ranks [0, 1, 2], 32 on rank [3]";
  expect_error(comm::disagreement("ctx", "num_experts", held, 0), message, {3});
  expect_error(comm::disagreement("ctx", "num_experts", held, 2), message, {3});
  expect_error(comm::disagreement("ctx", "num_experts", held, 3), message, {0, 1, 2});
}

TEST(Disagreement, ANoteFollowsAndTheRanksNeedNotStartAtZero) {
  // The ranks that took part (a shrunk group: rank 1 is gone); this rank (5) holds no listed value.
  const std::map<int, std::string> held{{0, "'cpu'"}, {2, "'cuda'"}, {4, "'cuda'"}};
  expect_error(comm::disagreement("[rank 5] provider choice", "the provider", held, 5, "rank 0: no torch.cuda"),
               "[rank 5] provider choice: ranks disagree on the provider: 'cpu' on rank [0], 'cuda' on ranks [2, 4]; "
               "rank 0: no torch.cuda",
               {0, 2, 4});
}

}  // namespace disagreement_test
}  // namespace moe_ep::testing
