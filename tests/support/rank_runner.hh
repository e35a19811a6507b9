// Runs a function on every rank of an in-process world (LocalWorld: one thread per rank) and
// collects what each rank returned, or the problems each rank found as strings, since a gtest assertion made on a rank thread
// would not stop the other ranks; then reports them as test failures from the test's thread.
#pragma once

#include <cstddef>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "moe_ep/group.hpp"

namespace moe_ep::testing {

// problems[r]: what rank r found (empty when everything matched).
using RankProblems = std::vector<std::vector<std::string>>;

// Runs fn(group, problems of that rank) on every rank of LocalWorld(ranks, topology).
RankProblems collect_on_ranks(int ranks, Topology topology,
                              const std::function<void(Group&, std::vector<std::string>&)>& fn);

// Runs fn on every rank of LocalWorld(ranks, topology) and returns what each rank returned
// (results[r]: rank r's), e.g. the error each rank's call threw (support/errors.hh).
template <class T>
std::vector<T> results_on_ranks(int ranks, Topology topology, const std::function<T(Group&)>& fn) {
  std::vector<T> results(static_cast<std::size_t>(ranks));
  LocalWorld(ranks, topology).run([&](Group& g) { results[static_cast<std::size_t>(g.rank())] = fn(g); });
  return results;
}

// How report_problems words its failures.
struct ProblemReport {
  std::string context;     // when not empty: the first line of every failure
  bool name_rank = false;  // prefix each problem with "rank R: "
  std::size_t max_per_rank = std::numeric_limits<std::size_t>::max();
};

// One ADD_FAILURE per problem (at most max_per_rank of each rank).
void report_problems(const RankProblems& problems, const ProblemReport& how = {});

// The number of problems of all ranks together.
std::size_t count_problems(const RankProblems& problems);

}  // namespace moe_ep::testing
