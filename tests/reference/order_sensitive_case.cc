#include "reference/order_sensitive_case.hh"

#include <cmath>

#include "reference/numeric_reference.hh"

namespace moe_ep::reference {
namespace {

constexpr int kRanks = 8, kExpertsPerRank = 4, kTopk = 4, kMaxTokens = 8, kTokens = 7;

// Token t of every source: (rank, local expert) per lane, rank -1 for an empty lane.
constexpr int kPatterns[kTokens][kTopk][2] = {
    {{1, 0}, {1, 1}, {1, 2}, {5, 0}},   // three lanes on rank 1
    {{1, 0}, {2, 0}, {3, 0}, {5, 0}},   // three ranks of node 0, one of node 1
    {{6, 3}, {2, 1}, {2, 2}, {1, 0}},   // master lanes out of rank order
    {{4, 0}, {4, 1}, {4, 2}, {4, 3}},   // four lanes on rank 4
    {{3, 1}, {-1, 0}, {0, 2}, {3, 2}},  // a masked lane
    {{7, 0}, {6, 0}, {5, 0}, {4, 0}},   // four ranks of node 1, in descending rank order
    {{0, 0}, {4, 1}, {1, 1}, {5, 1}},   // nodes alternating
};

// The lane whose output a (destination rank, local expert) row carries: the lane of that expert,
// or for a compact row (local expert -1) the destination's master lane (its highest lane).
int lane_of(int token, int dest, int local) {
  int lane = -1;
  for (int j = 0; j < kTopk; ++j)
    if (kPatterns[token][j][0] == dest && (local < 0 || kPatterns[token][j][1] == local)) lane = j;
  return lane;
}

// Element h uses one triple of lanes (a < b < c) and a sign: lane a gets +-B, lane b gets s, lane c
// gets -+B, other lanes 0, with s = 2^m and B = 2^24 s for m from -4 to 3.
std::uint16_t value(int dest, int local, int src_global, int h) {
  const int token = src_global % kMaxTokens;
  const int lane = token < kTokens ? lane_of(token, dest, local) : -1;
  constexpr int kTriples[4][3] = {{0, 1, 2}, {0, 1, 3}, {0, 2, 3}, {1, 2, 3}};
  const int* triple = kTriples[(h % 8) / 2];
  const float sign = h % 2 == 0 ? 1.0f : -1.0f;
  const float s = std::ldexp(1.0f, (h / 8) % 8 - 4), big = std::ldexp(s, 24);
  float v = 0.0f;
  if (lane == triple[0]) v = sign * big;
  if (lane == triple[1]) v = s;
  if (lane == triple[2]) v = -sign * big;
  return bf16_from_float(v);
}

}  // namespace

CaseSpec order_sensitive_case(int scaleout, bool hybrid, bool expand, bool multi, int num_bias) {
  CaseSpec s;
  s.ranks = kRanks;
  s.scaleout = scaleout;
  s.allow_hybrid = hybrid;
  s.multi = multi;
  s.expand = expand;
  s.alignment = expand ? 4 : 1;
  s.num_experts = kRanks * kExpertsPerRank;
  s.k = kTopk;
  s.max_tokens = kMaxTokens;
  s.hidden = 128;
  s.num_bias = num_bias;
  s.seed = 77;
  s.values = &value;
  for (int r = 0; r < kRanks; ++r) {
    s.tokens.push_back(kTokens);
    std::vector<std::int64_t> ids;
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kTopk; ++j)
        ids.push_back(kPatterns[t][j][0] < 0 ? -1 : std::int64_t{kPatterns[t][j][0]} * kExpertsPerRank + kPatterns[t][j][1]);
    s.fixed_topk.push_back(ids);
  }
  return s;
}

bool order_matters(const CaseSpec& spec, int level) {
  std::vector<RankInputs> all = make_all_inputs(spec);
  CaseSpec reversed = spec;
  reversed.reversed_levels = level;
  for (int r = 0; r < spec.ranks; ++r)
    if (reference_combine(spec, all, r, 1.0f).x != reference_combine(reversed, all, r, 1.0f).x) return true;
  return false;
}

}  // namespace moe_ep::reference
