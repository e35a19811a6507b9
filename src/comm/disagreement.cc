#include "comm/disagreement.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace moe_ep::comm {

std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("{} [{}]", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

std::optional<PeerError> disagreement(std::string_view context, std::string_view what,
                                      const std::map<int, std::string>& held, int self, std::string_view note) {
  std::map<std::string, std::vector<int>> holders;  // value -> its ranks, in rank order
  for (const auto& [rank, value] : held) holders[value].push_back(rank);
  if (holders.size() < 2) return std::nullopt;
  const auto mine = held.find(self);
  std::string detail;
  std::vector<int> blamed;
  for (const auto& [value, ranks] : holders) {
    detail += fmt::format("{}{} on {}", detail.empty() ? "" : ", ", value, rank_list(ranks));
    if (mine == held.end() || value != mine->second) blamed.insert(blamed.end(), ranks.begin(), ranks.end());
  }
  std::sort(blamed.begin(), blamed.end());
  return PeerError(fmt::format("{}: ranks disagree on {}: {}{}{}", context, what, detail, note.empty() ? "" : "; ", note),
                   std::move(blamed));
}

}  // namespace moe_ep::comm
