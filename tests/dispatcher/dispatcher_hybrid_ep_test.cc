// The dispatcher's HybridEP layout (MOE_EP_V2_NORMAL_LAYOUT = hybrid_ep, docs/dispatcher.md §4-§5)
// against a reference written here from HybridEP's rules: every rank regenerates every rank's
// inputs from seeds; the permuted rows are walked per local expert in ascending global source id,
// each group padded with zero rows to the alignment; the combine is summed in HybridEP's order
// (per rank the rows of its experts ascending, rounded once; the source's own node's ranks
// ascending; then each other node's sum, rounded once, in the order node - 1, node - 2, ...; one
// FP32 accumulator from +0, one rounding). One node of 4 ranks, 2 nodes of 2 and 3 nodes of 2
// (where the node order is not symmetric); BF16.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "moe_ep/dispatcher.hpp"
#include "moe_ep/error.hpp"
#include "reference/numeric_reference.hh"
#include "support/rank_runner.hh"

namespace moe_ep::testing {
namespace dispatcher_hybrid_ep_test {

constexpr int kHidden = 64, kLocalExperts = 3, kTopk = 4, kAlign = 4;

struct HybridEpInputs {
  std::vector<std::uint16_t> x;      // [N, H] bf16
  std::vector<std::int64_t> ids;     // [N, k]
  std::vector<float> weights;        // [N, k]
  int tokens = 0;
};

HybridEpInputs inputs_of(int rank, int experts) {
  std::mt19937 rng(900 + rank);
  HybridEpInputs in;
  in.tokens = 5 + 3 * rank;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Magnitudes 2^-12 .. 2^12: FP32 sums of such rows round differently in different orders.
  for (int i = 0; i < in.tokens * kHidden; ++i)
    in.x.push_back(reference::bf16_from_float(std::ldexp(normal(rng), static_cast<int>(rng() % 25) - 12)));
  for (int t = 0; t < in.tokens; ++t) {
    std::vector<std::int64_t> pool(static_cast<size_t>(experts));
    for (int e = 0; e < experts; ++e) pool[static_cast<size_t>(e)] = e;
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < kTopk; ++j) {
      in.ids.push_back(t % 7 == 3 || rng() % 5 == 0 ? -1 : pool[static_cast<size_t>(j)]);
      in.weights.push_back(0.25f + static_cast<float>(rng() % 64) / 64.0f);
    }
  }
  return in;
}

// The expert's output for a row of token x under expert e: bf16(x * f_e), where experts 4q and
// 4q + 1 give +-(1 + q/8) 2^20 x (they cancel exactly) and 4q + 2, 4q + 3 give (1 + q/8) x and
// (1 + q/8) 2^-3 x. A small row added to a large one before the large ones cancel loses bits
// that survive the final BF16 rounding, so every difference in the order of the sums shows.
std::uint16_t expert_value(std::uint16_t x, int e, float) {
  const int q = e / 4, kind = e % 4;
  const float scale = 1.0f + static_cast<float>(q) / 8.0f;
  const float f = kind == 0 ? std::ldexp(scale, 20) : kind == 1 ? -std::ldexp(scale, 20) : kind == 2 ? scale : std::ldexp(scale, -3);
  return reference::bf16_from_float(reference::float_from_bf16(x) * f);
}

float weight_of(const HybridEpInputs& in, int t, int e) {
  for (int j = 0; j < kTopk; ++j)
    if (in.ids[static_cast<size_t>(t * kTopk + j)] == e) return in.weights[static_cast<size_t>(t * kTopk + j)];
  return -1.0f;  // not routed
}

// Rank r's partial of token t of `src` at hidden index h: bf16 of its experts' rows, ascending;
// nullopt when r received no row of it.
std::optional<float> partial(const HybridEpInputs& src, int t, int r, int h) {
  float acc = 0.0f;
  bool any = false;
  for (int e = r * kLocalExperts; e < (r + 1) * kLocalExperts; ++e) {
    const float w = weight_of(src, t, e);
    if (w < 0) continue;
    acc += reference::float_from_bf16(expert_value(src.x[static_cast<size_t>(t * kHidden + h)], e, w));
    any = true;
  }
  if (!any) return std::nullopt;
  return reference::float_from_bf16(reference::bf16_from_float(acc));
}

std::uint16_t reference_combined(const HybridEpInputs& src, int source, int t, int h, int ranks, int per_node) {
  const int nodes = ranks / per_node, own = source / per_node;
  float acc = 0.0f;
  for (int r = own * per_node; r < (own + 1) * per_node; ++r)
    if (auto p = partial(src, t, r, h)) acc += *p;
  for (int step = 1; step < nodes; ++step) {
    const int node = ((own - step) % nodes + nodes) % nodes;
    float sum = 0.0f;
    bool any = false;
    for (int r = node * per_node; r < (node + 1) * per_node; ++r)
      if (auto p = partial(src, t, r, h)) {
        sum += *p;
        any = true;
      }
    if (any) acc += reference::float_from_bf16(reference::bf16_from_float(sum));
  }
  return reference::bf16_from_float(acc);
}

void check_rank(Group& g, int nodes, std::vector<std::string>& out) {
  const int R = g.size(), E = R * kLocalExperts, r = g.rank();
  std::vector<HybridEpInputs> all;
  for (int s = 0; s < R; ++s) all.push_back(inputs_of(s, E));
  const HybridEpInputs& mine = all[static_cast<size_t>(r)];
  BufferCache cache(g);
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = E;
  o.num_topk = kTopk;
  o.use_v2 = true;
  o.mode = DispatchMode::kNormal;
  o.v2_normal_layout = V2NormalLayout::kHybridEp;
  o.expert_alignment = kAlign;
  o.num_max_prefill_tokens_per_rank = 64;
  o.timeout_secs = 60;
  o.provider_path = "cpu";
  TokenDispatcher d(cache, o);
  Tensor x = Tensor::empty({mine.tokens, kHidden}, DType::kBF16), ids = Tensor::empty({mine.tokens, kTopk}, DType::kInt64),
         w = Tensor::empty({mine.tokens, kTopk}, DType::kFP32);
  std::copy(mine.x.begin(), mine.x.end(), x.data_as<std::uint16_t>());
  std::copy(mine.ids.begin(), mine.ids.end(), ids.data_as<std::int64_t>());
  std::copy(mine.weights.begin(), mine.weights.end(), w.data_as<float>());
  const DispatchOutput got = d.dispatch(x, ids, w, BatchKind::kPrefill);
  if (got.format != OutputFormat::kHybridEp) out.push_back("format is not hybrid_ep");
  // The permuted rows: per local expert, ascending (source, token), padded with zero rows.
  std::vector<std::uint16_t> want_rows;
  std::vector<float> want_w;
  std::vector<int> want_expert;  // global expert of each row, -1 for padding
  for (int le = 0; le < kLocalExperts; ++le) {
    const int e = r * kLocalExperts + le;
    std::size_t count = 0;
    for (int s = 0; s < R; ++s)
      for (int t = 0; t < all[static_cast<size_t>(s)].tokens; ++t) {
        const float wt = weight_of(all[static_cast<size_t>(s)], t, e);
        if (wt < 0) continue;
        const auto& xs = all[static_cast<size_t>(s)].x;
        want_rows.insert(want_rows.end(), xs.begin() + t * kHidden, xs.begin() + (t + 1) * kHidden);
        want_w.push_back(wt);
        want_expert.push_back(e);
        ++count;
      }
    for (; count % kAlign != 0; ++count) {
      want_rows.insert(want_rows.end(), kHidden, 0);
      want_w.push_back(0.0f);
      want_expert.push_back(-1);
    }
  }
  const std::int64_t M = static_cast<std::int64_t>(want_w.size());
  if (got.hidden_states.size(0) != M) {
    out.push_back(fmt::format("{} permuted rows, expected {}", got.hidden_states.size(0), M));
    return;
  }
  if (!std::equal(want_rows.begin(), want_rows.end(), got.hidden_states.data_as<const std::uint16_t>()))
    out.push_back("permuted rows differ");
  if (!std::equal(want_w.begin(), want_w.end(), got.topk_weights.data_as<const float>())) out.push_back("probs differ");
  // The experts' outputs, weighted; padding rows are garbage the combine must ignore.
  Tensor y = Tensor::empty({M, kHidden}, DType::kBF16);
  for (std::int64_t i = 0; i < M; ++i)
    for (int h = 0; h < kHidden; ++h)
      y.data_as<std::uint16_t>()[i * kHidden + h] =
          want_expert[static_cast<size_t>(i)] < 0
              ? 0x7fc0
              : expert_value(want_rows[static_cast<size_t>(i * kHidden + h)], want_expert[static_cast<size_t>(i)],
                             want_w[static_cast<size_t>(i)]);
  const Tensor combined = d.combine(y);
  const int per_node = R / nodes;
  std::size_t wrong = 0;
  for (int t = 0; t < mine.tokens; ++t)
    for (int h = 0; h < kHidden; ++h)
      wrong += combined.data_as<const std::uint16_t>()[t * kHidden + h] != reference_combined(mine, r, t, h, R, per_node);
  if (wrong) out.push_back(fmt::format("{} combined elements differ from HybridEP's order", wrong));
}

TEST(DispatcherHybridEp, PermutedRowsAndCombineMatchHybridEpsOrder) {
  for (const auto& [ranks, nodes] : std::vector<std::pair<int, int>>{{4, 1}, {4, 2}, {6, 3}}) {
    const int n = nodes;
    auto problems = collect_on_ranks(ranks, {n}, [n](Group& g, std::vector<std::string>& out) { check_rank(g, n, out); });
    report_problems(problems, {.context = fmt::format("{} ranks on {} nodes", ranks, nodes), .name_rank = true});
  }
}

TEST(DispatcherHybridEp, AcrossNodesNeedsHybridModeAndMultipleReduction) {
  auto problems = collect_on_ranks(4, {2}, [](Group& g, std::vector<std::string>& out) {
    BufferCache cache(g);
    for (const bool hybrid : {false, true}) {
      DispatcherOptions o;
      o.hidden = kHidden;
      o.num_experts = 4 * kLocalExperts;
      o.num_topk = kTopk;
      o.use_v2 = true;
      o.v2_normal_layout = V2NormalLayout::kHybridEp;
      o.allow_hybrid_mode = hybrid;
      o.allow_multiple_reduction = !hybrid;
      o.provider_path = "cpu";
      try {
        TokenDispatcher d(cache, o);
        out.push_back("accepted");
      } catch (const InvalidArgument& e) {
        const std::string want = hybrid ? "allow_multiple_reduction" : "allow_hybrid_mode";
        if (std::string(e.what()).find(want) == std::string::npos) out.push_back(std::string("message: ") + e.what());
      }
    }
  });
  report_problems(problems, {.name_rank = true});
}

}  // namespace dispatcher_hybrid_ep_test
}  // namespace moe_ep::testing
