// Combine with own_node_rank_terms (CombineExtras, engine::CombineRequest): in hybrid mode
// with multiple reduction, the source node's rank units are terms of the final FP32 sum one by
// one, while every other node still contributes one BF16-rounded level-2 unit. Checked on 2 nodes
// of 2 ranks (threads), compact and expanded layouts, against a reference sum written here from
// the rule: units in ascending key order (a rank's key: its master lane; another node's: its
// master lane), FP32 with the first term as is, one BF16 rounding; compact weights summed over
// the units' whole weight rows (sum_weights_over_ranks). The expert outputs spread over many
// binades, so rounding the own node's part first (the default) gives other bits; the test checks
// that too, so it fails if the option is ignored.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moe_ep/elastic_buffer.hpp"
#include "reference/numeric_reference.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace elastic_own_node_terms_test {

using reference::bf16_from_float;
using reference::float_from_bf16;

constexpr int kRanks = 4, kScaleout = 2, kScaleup = 2, kExperts = 8, kLocal = 2, kTopk = 5, kTokens = 12,
              kHidden = 32;

// Top-k ids of every rank's tokens: distinct experts (1 to kTopk of them) in random lane order,
// some lanes -1.
std::vector<std::int64_t> topk_of(int rank) {
  std::mt19937 gen(static_cast<std::uint32_t>(100 + rank));
  std::vector<std::int64_t> ids(static_cast<size_t>(kTokens * kTopk), -1);
  for (int t = 0; t < kTokens; ++t) {
    std::vector<std::int64_t> experts(kExperts);
    for (int e = 0; e < kExperts; ++e) experts[static_cast<size_t>(e)] = e;
    std::shuffle(experts.begin(), experts.end(), gen);
    const int count = 1 + static_cast<int>(gen() % kTopk);
    for (int j = 0; j < count; ++j) ids[static_cast<size_t>(t * kTopk + j)] = experts[static_cast<size_t>(j)];
    std::shuffle(ids.begin() + t * kTopk, ids.begin() + (t + 1) * kTopk, gen);
  }
  return ids;
}

// The expert output of rank `rank` for lane `lane` (-1: the compact row) of token (src, t), as
// BF16 bits: a random sign and mantissa over 2^-12 .. 2^4.
std::uint16_t output_of(int rank, int lane, int src, int t, int h) {
  std::uint32_t x = ((static_cast<std::uint32_t>(rank * 7 + lane + 1) * 131u + static_cast<std::uint32_t>(src)) * 977u +
                     static_cast<std::uint32_t>(t)) * 4099u + static_cast<std::uint32_t>(h);
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  const float mantissa = 1.0f + static_cast<float>(x & 0x7f) / 128.0f;
  const float value = std::ldexp(mantissa, static_cast<int>((x >> 8) % 17) - 12) * ((x >> 16) & 1 ? -1.0f : 1.0f);
  return bf16_from_float(value);
}

float weight_of(int rank, int src, int t, int j) {
  return static_cast<float>(((rank * 31 + src) * 17 + t) * 13 + j) / 7.0f + 0.1f * static_cast<float>(j);
}

struct Unit {
  int key;
  std::vector<float> row;  // FP32 values of the unit's BF16 row
  std::array<float, kTopk> weights;
};

float sum_in_order(const std::vector<float>& terms) {
  float acc = terms.empty() ? 0.0f : terms[0];
  for (std::size_t i = 1; i < terms.size(); ++i) acc += terms[i];
  return acc;
}

// Rank d's unit of token (src, t): its row (compact) or the BF16 sum of its lanes' rows.
Unit rank_unit(int d, int src, int t, const std::int64_t* ids, bool expand) {
  Unit u{-1, std::vector<float>(kHidden), {}};
  std::vector<int> lanes;
  for (int j = 0; j < kTopk; ++j)
    if (ids[j] >= 0 && ids[j] / kLocal == d) lanes.push_back(j);
  u.key = lanes.back();
  for (int h = 0; h < kHidden; ++h) {
    if (!expand) {
      u.row[static_cast<size_t>(h)] = float_from_bf16(output_of(d, -1, src, t, h));
      continue;
    }
    std::vector<float> terms;
    for (int j : lanes) terms.push_back(float_from_bf16(output_of(d, j, src, t, h)));
    u.row[static_cast<size_t>(h)] = float_from_bf16(bf16_from_float(sum_in_order(terms)));
  }
  for (int j = 0; j < kTopk; ++j) u.weights[static_cast<size_t>(j)] = weight_of(d, src, t, j);
  return u;
}

// Reference combined row and weights of token t of rank src; `rounded_own_node`: the default
// scheme instead (the own node as one rounded unit), to show the case tells them apart.
std::pair<std::vector<std::uint16_t>, std::array<float, kTopk>> reference_token(int src, int t, bool expand,
                                                                                 bool rounded_own_node) {
  const std::vector<std::int64_t> all = topk_of(src);
  const std::int64_t* ids = &all[static_cast<size_t>(t * kTopk)];
  std::vector<Unit> units;
  for (int node = 0; node < kScaleout; ++node) {
    std::vector<Unit> ranks;
    for (int d = node * kScaleup; d < (node + 1) * kScaleup; ++d)
      if (std::any_of(ids, ids + kTopk, [&](std::int64_t e) { return e >= 0 && e / kLocal == d; }))
        ranks.push_back(rank_unit(d, src, t, ids, expand));
    std::sort(ranks.begin(), ranks.end(), [](const Unit& a, const Unit& b) { return a.key < b.key; });
    if (ranks.empty()) continue;
    if (node == src / kScaleup && !rounded_own_node) {
      units.insert(units.end(), ranks.begin(), ranks.end());
      continue;
    }
    Unit level2{ranks.back().key, std::vector<float>(kHidden), {}};
    for (int h = 0; h < kHidden; ++h) {
      std::vector<float> terms;
      for (const Unit& r : ranks) terms.push_back(r.row[static_cast<size_t>(h)]);
      level2.row[static_cast<size_t>(h)] = float_from_bf16(bf16_from_float(sum_in_order(terms)));
    }
    for (int j = 0; j < kTopk; ++j) {
      std::vector<float> terms;
      for (const Unit& r : ranks) terms.push_back(r.weights[static_cast<size_t>(j)]);
      level2.weights[static_cast<size_t>(j)] = sum_in_order(terms);
    }
    units.push_back(level2);
  }
  std::sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.key < b.key; });
  std::vector<std::uint16_t> row(kHidden);
  for (int h = 0; h < kHidden; ++h) {
    std::vector<float> terms;
    for (const Unit& u : units) terms.push_back(u.row[static_cast<size_t>(h)]);
    row[static_cast<size_t>(h)] = bf16_from_float(sum_in_order(terms));
  }
  std::array<float, kTopk> weights{};
  for (int j = 0; j < kTopk; ++j) {
    std::vector<float> terms;
    for (const Unit& u : units) terms.push_back(u.weights[static_cast<size_t>(j)]);
    weights[static_cast<size_t>(j)] = sum_in_order(terms);
  }
  return {row, weights};
}

// Expert outputs (and compact weights) for the rows this rank received.
void fill_outputs(int me, const DispatchResult& r, bool expand, Tensor& y, Tensor& w) {
  const Tensor& meta = r.handle->recv_src_metadata;
  const std::int64_t rows = r.handle->num_recv_tokens;
  y = Tensor::zeros({expand ? r.handle->num_expanded_tokens : rows, kHidden}, DType::kBF16);
  w = Tensor::zeros({rows, kTopk}, DType::kFP32);
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int32_t* m = meta.data_as<std::int32_t>() + i * meta.stride(0);
    const int src = m[0] / kTokens, t = m[0] % kTokens;
    for (int j = 0; j < kTopk; ++j) w.data_as<float>()[i * kTopk + j] = weight_of(me, src, t, j);
    for (int h = 0; h < kHidden; ++h) {
      if (!expand) y.data_as<std::uint16_t>()[i * kHidden + h] = output_of(me, -1, src, t, h);
      for (int j = 0; j < kTopk && expand; ++j)
        if (m[2 + j] >= 0) y.data_as<std::uint16_t>()[m[2 + j] * kHidden + h] = output_of(me, j, src, t, h);
    }
  }
}

TEST(OwnNodeRankTerms, OwnNodeRanksAreTermsOtherNodesOneRoundedUnit) {
  for (bool expand : {false, true}) {
    // The case distinguishes the two schemes.
    bool differs = false;
    for (int s = 0; s < kRanks; ++s)
      for (int t = 0; t < kTokens; ++t)
        differs |= reference_token(s, t, expand, false).first != reference_token(s, t, expand, true).first;
    EXPECT_TRUE(differs) << "the case cannot tell the schemes apart";
    const auto failures = testing::collect_on_ranks(
        kRanks, {.num_scaleout = kScaleout}, [&](Group& g, std::vector<std::string>& bad) {
          const int me = g.rank();
          ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk});
          std::vector<std::int64_t> ids = topk_of(me);
          Tensor x = Tensor::zeros({kTokens, kHidden}, DType::kBF16);
          const DispatchResult r = b.dispatch({.x = x,
                                               .topk_idx = TensorView(ids.data(), DType::kInt64, {kTokens, kTopk}),
                                               .num_experts = kExperts,
                                               .do_expand = expand});
          Tensor y, w;
          fill_outputs(me, r, expand, y, w);
          CombineArgs a{.x = y, .handle = r.handle};
          if (!expand) a.topk_weights = w;
          const CombineResult c = b.combine(
              a, CombineExtras{.sum_weights_over_ranks = !expand, .own_node_rank_terms = true});
          for (int t = 0; t < kTokens; ++t) {
            const auto [row, weights] = reference_token(me, t, expand, false);
            if (!std::equal(row.begin(), row.end(), c.combined_x.data_as<std::uint16_t>() + t * kHidden))
              bad.push_back(fmt::format("token {}: combined row differs from the reference", t));
            if (!expand && !std::equal(weights.begin(), weights.end(), c.combined_topk_weights.data_as<float>() + t * kTopk))
              bad.push_back(fmt::format("token {}: combined weights differ from the reference", t));
          }
        });
    testing::report_problems(failures, {.context = expand ? "expanded" : "compact", .name_rank = true});
  }
}

}  // namespace elastic_own_node_terms_test
}  // namespace moe_ep
