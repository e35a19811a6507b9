// Disagreement: the one text of an error raised when the ranks of one collective step hold
// different values of something every rank must share, and the one text of a list of ranks.
//
// rank_list({3}) is "rank [3]"; rank_list({0, 2, 5}) is "ranks [0, 2, 5]" (the ranks in the order
// given, no ranges).
//
// disagreement() reads
//     "<context>: ranks disagree on <what>: <value> on <ranks>, <value> on <ranks>[; <note>]"
// Each value appears once, in the byte order of its text (so "16" before "8"), followed by the
// ranks holding it (rank_list, in rank order). The text is the same on every rank.
//
// Blame rule: the error names (ranks(), in rank order) the ranks that hold a value other than
// this rank's own (`self`). So each side of a split names the other side, whichever is larger,
// and a rank that holds none of the listed values names them all.
//
// The error is a PeerError, what every collective agreement raises. A caller whose failure is of
// another kind throws that type with the same message (the buffer cache raises StateError when
// its ranks do not all hold the requested buffer: the channel is out of step, not an argument).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe_ep/error.hpp"

namespace moe_ep::comm {

// "rank [r]" for one rank, "ranks [a, b, ...]" otherwise.
std::string rank_list(const std::vector<int>& ranks);

// The disagreement of `held` (each rank that took part -> the text of its value) on `what`, seen
// from rank `self`; `note` (when not empty) follows after "; ". nullopt when every rank holds the
// same value. Callers throw it: `if (auto e = disagreement(...)) throw *e;`.
std::optional<PeerError> disagreement(std::string_view context, std::string_view what,
                                      const std::map<int, std::string>& held, int self, std::string_view note = {});

}  // namespace moe_ep::comm
