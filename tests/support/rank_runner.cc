#include "support/rank_runner.hh"

#include <gtest/gtest.h>

#include <algorithm>

namespace moe_ep::testing {

RankProblems collect_on_ranks(int ranks, Topology topology,
                              const std::function<void(Group&, std::vector<std::string>&)>& fn) {
  RankProblems problems(static_cast<std::size_t>(ranks));
  LocalWorld(ranks, topology).run([&](Group& g) { fn(g, problems[static_cast<std::size_t>(g.rank())]); });
  return problems;
}

void report_problems(const RankProblems& problems, const ProblemReport& how) {
  for (std::size_t r = 0; r < problems.size(); ++r) {
    const auto& mine = problems[r];
    for (std::size_t i = 0; i < std::min(mine.size(), how.max_per_rank); ++i) {
      const std::string context = how.context.empty() ? "" : how.context + "\n  ";
      const std::string rank = how.name_rank ? "rank " + std::to_string(r) + ": " : "";
      ADD_FAILURE() << context << rank << mine[i];
    }
  }
}

std::size_t count_problems(const RankProblems& problems) {
  std::size_t n = 0;
  for (const auto& mine : problems) n += mine.size();
  return n;
}

}  // namespace moe_ep::testing
