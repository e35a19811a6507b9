#include "comm/peer_failure.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "comm/transport.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::comm {
namespace {

// The ranks to name for departures: the culprits their failures named (other than this rank), or
// the departed ranks themselves when they failed on their own account (or blamed only this rank).
std::vector<int> root_cause(int rank, const std::vector<std::pair<int, Departure>>& departed) {
  std::vector<int> culprits, ranks;
  for (const auto& [r, why] : departed) {
    ranks.push_back(r);
    for (int c : why.culprits)
      if (c != rank && std::find(culprits.begin(), culprits.end(), c) == culprits.end()) culprits.push_back(c);
  }
  std::sort(culprits.begin(), culprits.end());
  return culprits.empty() ? ranks : culprits;
}

std::string reasons_of(const std::vector<std::pair<int, Departure>>& departed) {
  std::string reasons;
  for (const auto& [r, why] : departed) reasons += fmt::format("; rank {} {}", r, why.reason);
  return reasons;
}

}  // namespace

Departure gave_up(const std::string& reason, std::vector<int> culprits) {
  return {"gave up on this channel: " + reason, std::move(culprits)};
}

std::vector<int> culprits_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const PeerError& e) {
    return e.ranks();
  } catch (...) {
    return {};
  }
}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

void fail_wait(int rank, const Wait& wait, const std::vector<int>& missing, double elapsed_secs,
               const std::function<std::optional<Departure>(int)>& departure) {
  std::vector<std::pair<int, Departure>> departed;
  std::vector<int> ranks;
  for (int r : missing)
    if (auto why = departure(r)) {
      ranks.push_back(r);
      departed.emplace_back(r, std::move(*why));
    }
  if (!departed.empty())
    throw PeerError(fmt::format("[rank {}] {}: ranks [{}] left the group instead of arriving{}", rank, wait.phase,
                                fmt::join(ranks, ", "), reasons_of(departed)),
                    root_cause(rank, departed));
  throw TimeoutError(fmt::format("[rank {}] {}: timed out after {:.1f} s (timeout {:g} s) waiting for ranks [{}]", rank,
                                 wait.phase, elapsed_secs, wait.timeout_secs, fmt::join(missing, ", ")),
                     missing);
}

void fail_channel_left(int rank, const Wait& wait, const std::vector<int>& missing,
                       const std::vector<std::pair<int, Departure>>& departed) {
  std::vector<int> ranks;
  for (const auto& [r, why] : departed) ranks.push_back(r);
  throw PeerError(fmt::format("[rank {}] {}: ranks [{}] gave up on this channel while this rank waited for ranks [{}]{}",
                              rank, wait.phase, fmt::join(ranks, ", "), fmt::join(missing, ", "),
                              reasons_of(departed)),
                  root_cause(rank, departed));
}

void fail_wait_chain(int rank, const Wait& wait, const std::vector<int>& missing, double elapsed_secs,
                     const std::function<const std::vector<int>*(int)>& waits_for) {
  // Follow each chain r -> the ranks r waits for. The ends are the ranks that wait for nobody
  // (other than this rank); ranks that wait for others are alive and stuck behind them. Chains
  // that only go round (live ranks waiting for each other) have no end: then all their ranks.
  std::vector<int> ends, seen{rank}, passed;
  std::vector<std::string> links;
  std::vector<int> frontier = missing;
  while (!frontier.empty()) {
    const int r = frontier.back();
    frontier.pop_back();
    if (std::find(seen.begin(), seen.end(), r) != seen.end()) continue;
    seen.push_back(r);
    passed.push_back(r);
    std::vector<int> onward;
    if (const std::vector<int>* next = waits_for(r))
      for (int n : *next)
        if (n != rank) onward.push_back(n);
    if (onward.empty()) {
      ends.push_back(r);
      continue;
    }
    links.push_back(fmt::format("rank {} waits for ranks [{}]", r, fmt::join(onward, ", ")));
    frontier.insert(frontier.end(), onward.begin(), onward.end());
  }
  if (ends.empty()) ends = passed;
  std::sort(ends.begin(), ends.end());
  std::sort(links.begin(), links.end());
  std::string chain;
  for (const std::string& link : links) chain += "; " + link;
  throw TimeoutError(fmt::format("[rank {}] {}: timed out after {:.1f} s (timeout {:g} s) waiting for ranks [{}]{}",
                                 rank, wait.phase, elapsed_secs, wait.timeout_secs, fmt::join(missing, ", "), chain),
                     links.empty() ? missing : ends);
}

void fail_abandoned(int rank, const Wait& wait, const std::vector<std::pair<int, Departure>>& departed) {
  std::vector<int> ranks;
  for (const auto& [r, why] : departed) ranks.push_back(r);
  throw PeerError(fmt::format("[rank {}] {}: ranks [{}] took part and then left (what they published is gone){}",
                              rank, wait.phase, fmt::join(ranks, ", "), reasons_of(departed)),
                  root_cause(rank, departed));
}

void fail_departed(int rank, const char* phase, int peer, Departure why) {
  std::vector<std::pair<int, Departure>> departed;
  departed.emplace_back(peer, std::move(why));
  throw PeerError(fmt::format("[rank {}] {}: rank {} left instead of arriving{}", rank, phase, peer,
                              reasons_of(departed)),
                  root_cause(rank, departed));
}

}  // namespace moe_ep::comm
