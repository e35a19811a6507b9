#include "reference/dense_reference.hh"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <stdexcept>

#include "reference/numeric_reference.hh"

namespace moe_ep::reference {
namespace {

int rank_of(const CaseSpec& s, std::int64_t e) { return static_cast<int>(e / s.experts_per_rank()); }
int node_of(const CaseSpec& s, int r) { return r / (s.ranks / s.routing_nodes()); }

int highest_lane_on(const CaseSpec& s, const std::int64_t* ids, int d) {
  for (int j = s.k - 1; j >= 0; --j)
    if (ids[j] >= 0 && rank_of(s, ids[j]) == d) return j;
  return -1;
}

// One rounding after summing in order, the first input taken as is; a single input passes.
std::vector<std::uint16_t> round_sum(std::vector<const std::uint16_t*> inputs, int hidden, bool reversed = false) {
  std::vector<std::uint16_t> out(static_cast<size_t>(hidden), 0);
  if (inputs.empty()) return out;
  if (reversed) std::reverse(inputs.begin(), inputs.end());
  for (int h = 0; h < hidden; ++h) {
    float acc = float_from_bf16(inputs[0][h]);
    for (std::size_t i = 1; i < inputs.size(); ++i) acc = acc + float_from_bf16(inputs[i][h]);
    out[static_cast<size_t>(h)] = bf16_from_float(acc);
  }
  return out;
}

}  // namespace

RankInputs make_inputs(const CaseSpec& spec, int rank) {
  RankInputs in;
  in.num_tokens = spec.tokens.at(static_cast<size_t>(rank));
  std::mt19937_64 rng(spec.seed * 1000003ULL + static_cast<std::uint64_t>(rank) * 7919ULL);
  const int n = in.num_tokens;
  in.x.resize(static_cast<size_t>(n) * spec.row_bytes());
  if (spec.payload_element_bytes > 0) {  // any bits: NaN patterns and all, they must arrive unchanged
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& b : in.x) b = static_cast<std::uint8_t>(byte(rng));
  } else if (spec.fp8) {
    std::uniform_int_distribution<int> code(0, 255);
    for (auto& b : in.x) b = static_cast<std::uint8_t>(code(rng));
    in.scales.resize(static_cast<size_t>(n) * spec.scale_cols);
    std::uniform_real_distribution<float> scale(0.001f, 2.0f);
    for (auto& v : in.scales) v = bits_of(scale(rng));
  } else {
    std::normal_distribution<float> value(0.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-24, 8);
    for (int i = 0; i < n * spec.hidden; ++i) {
      const float v = spec.wide_range ? std::ldexp(value(rng), exponent(rng)) : value(rng);
      const std::uint16_t b = bf16_from_float(v);
      in.x[static_cast<size_t>(2 * i)] = static_cast<std::uint8_t>(b & 0xff);
      in.x[static_cast<size_t>(2 * i + 1)] = static_cast<std::uint8_t>(b >> 8);
    }
  }
  // Routing: k distinct experts per token, drawn with weights ~ (e+1)^-skew; then masks.
  std::vector<double> affinity(static_cast<size_t>(spec.num_experts));
  for (int e = 0; e < spec.num_experts; ++e) affinity[static_cast<size_t>(e)] = std::pow(e + 1.0, -spec.skew);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  in.topk.resize(static_cast<size_t>(n) * spec.k);
  in.weights.resize(static_cast<size_t>(n) * spec.k);
  // Style 2: every token to the experts of one rank, the same rank for every source.
  const int only_rank = static_cast<int>(spec.seed % static_cast<std::uint64_t>(spec.ranks));
  for (int t = 0; t < n; ++t) {
    std::vector<int> order(static_cast<size_t>(spec.num_experts));
    for (int e = 0; e < spec.num_experts; ++e) order[static_cast<size_t>(e)] = e;
    if (spec.routing_style == 2) {
      const int El = spec.experts_per_rank();
      for (int i = 0; i < El; ++i) order[static_cast<size_t>(i)] = only_rank * El + i;
      std::shuffle(order.begin(), order.begin() + El, rng);
      for (int j = El; j < spec.num_experts; ++j) order[static_cast<size_t>(j)] = -1;
    } else if (spec.routing_style != 1 || t == 0) {
      std::vector<double> keys(static_cast<size_t>(spec.num_experts));
      for (int e = 0; e < spec.num_experts; ++e)  // weighted sampling without replacement
        keys[static_cast<size_t>(e)] = std::log(uniform(rng) + 1e-300) / affinity[static_cast<size_t>(e)];
      std::partial_sort(order.begin(), order.begin() + spec.k, order.end(),
                        [&](int a, int b) { return keys[static_cast<size_t>(a)] > keys[static_cast<size_t>(b)]; });
    }
    for (int j = 0; j < spec.k; ++j) {
      const bool masked = uniform(rng) < spec.mask_ratio;
      std::int64_t id = masked ? -1 : order[static_cast<size_t>(j)];
      if (spec.routing_style == 1 && t > 0) id = in.topk[static_cast<size_t>(j)];  // the first token's row
      in.topk[static_cast<size_t>(t * spec.k + j)] = id;
      in.weights[static_cast<size_t>(t * spec.k + j)] = id < 0 ? 0.0f : static_cast<float>(uniform(rng));
    }
  }
  if (static_cast<size_t>(rank) < spec.fixed_topk.size()) {
    const auto& ids = spec.fixed_topk[static_cast<size_t>(rank)];
    if (ids.size() != in.topk.size()) throw std::invalid_argument("fixed_topk: wrong size for the rank's tokens");
    in.topk = ids;
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0) in.weights[i] = 0.0f;
  }
  std::normal_distribution<float> bias_value(0.0f, 0.5f);
  for (int b = 0; b < spec.num_bias; ++b) {
    in.bias.emplace_back(static_cast<size_t>(n) * spec.hidden);
    for (auto& v : in.bias.back()) v = bf16_from_float(bias_value(rng));
  }
  return in;
}

std::vector<RankInputs> make_all_inputs(const CaseSpec& spec) {
  std::vector<RankInputs> all;
  for (int r = 0; r < spec.ranks; ++r) all.push_back(make_inputs(spec, r));
  return all;
}

RefDispatch reference_dispatch(const CaseSpec& spec, const std::vector<RankInputs>& all, int dest) {
  RefDispatch out;
  const int El = spec.experts_per_rank(), k = spec.k;
  out.per_source.assign(static_cast<size_t>(spec.ranks), 0);
  for (int s = 0; s < spec.ranks; ++s) {
    for (int t = 0; t < all[static_cast<size_t>(s)].num_tokens; ++t) {
      const std::int64_t* ids = &all[static_cast<size_t>(s)].topk[static_cast<size_t>(t * k)];
      const int master = highest_lane_on(spec, ids, dest);
      if (master < 0) continue;
      ReceivedRow row{s, t, master, {}, std::vector<int>(static_cast<size_t>(k), -1)};
      for (int j = 0; j < k; ++j)
        row.local_ids.push_back(ids[j] >= 0 && rank_of(spec, ids[j]) == dest ? ids[j] - std::int64_t{dest} * El : -1);
      out.rows.push_back(row);
      ++out.per_source[static_cast<size_t>(s)];
    }
  }
  out.unaligned.assign(static_cast<size_t>(El), 0);
  for (const auto& r : out.rows)
    for (int j = 0; j < k; ++j)
      if (r.local_ids[static_cast<size_t>(j)] >= 0) ++out.unaligned[static_cast<size_t>(r.local_ids[static_cast<size_t>(j)])];
  int start = 0;
  for (int i = 0; i < El; ++i) {
    out.start.push_back(start);
    start += (out.unaligned[static_cast<size_t>(i)] + spec.alignment - 1) / spec.alignment * spec.alignment;
  }
  out.expanded_rows = start;
  out.expanded_owner.assign(static_cast<size_t>(start), {-1, -1});
  for (int i = 0; i < El; ++i) {
    int next = out.start[static_cast<size_t>(i)];
    for (std::size_t r = 0; r < out.rows.size(); ++r)
      for (int j = 0; j < k; ++j)
        if (out.rows[r].local_ids[static_cast<size_t>(j)] == i) {
          out.rows[r].expanded_rows[static_cast<size_t>(j)] = next;
          out.expanded_owner[static_cast<size_t>(next++)] = {static_cast<int>(r), j};
        }
  }
  return out;
}

std::uint16_t expert_value(int dest, int local_expert, int src_global, int h) {
  // Magnitudes spread over 2^-20 .. 2^20, so FP32 sums of a few of them round: the result
  // depends on the summation order, which the tests therefore check.
  const double v = std::sin(0.37 * src_global + 0.011 * h + 1.3 * dest + 0.7 * (local_expert + 2));
  const int exponent = (src_global * 7 + dest * 13 + (local_expert + 1) * 5 + h * 3) % 41 - 20;
  return bf16_from_float(static_cast<float>(std::ldexp(v, exponent)));
}

std::uint16_t CaseSpec::value(int dest, int local_expert, int src_global, int h) const {
  return values ? values(dest, local_expert, src_global, h) : expert_value(dest, local_expert, src_global, h);
}

RefCombine reference_combine(const CaseSpec& spec, const std::vector<RankInputs>& all, int source,
                             float weight_scale) {
  const int k = spec.k, H = spec.hidden, El = spec.experts_per_rank();
  const RankInputs& in = all[static_cast<size_t>(source)];
  RefCombine out;
  out.x.resize(static_cast<size_t>(in.num_tokens) * H);
  out.weights.assign(static_cast<size_t>(in.num_tokens) * k, 0.0f);
  std::map<std::tuple<int, int, int>, std::vector<std::uint16_t>> rows;  // storage for expert rows
  auto expert_row = [&](int d, int local, int src_global, float weight = 1.0f) -> const std::uint16_t* {
    auto& row = rows[{d, local, src_global}];
    if (row.empty())
      for (int h = 0; h < H; ++h) {
        const std::uint16_t v = spec.value(d, local, src_global, h);
        row.push_back(spec.weight_lanes && local >= 0 ? bf16_from_float(weight * float_from_bf16(v)) : v);
      }
    return row.data();
  };
  for (int t = 0; t < in.num_tokens; ++t) {
    const std::int64_t* ids = &in.topk[static_cast<size_t>(t * k)];
    const int g = source * spec.max_tokens + t;
    std::vector<std::vector<std::uint16_t>> temps;
    temps.reserve(4 * static_cast<size_t>(k) + 4);
    auto keep = [&](std::vector<std::uint16_t> v) {
      temps.push_back(std::move(v));
      return temps.back().data();
    };
    // Contribution of rank d: its compact row, or the level-1 sum of its lanes (expanded).
    auto rank_contribution = [&](int d) -> const std::uint16_t* {
      if (!spec.expand) return expert_row(d, -1, g);
      std::vector<const std::uint16_t*> lanes;
      for (int j = 0; j < k; ++j)
        if (ids[j] >= 0 && rank_of(spec, ids[j]) == d)
          lanes.push_back(expert_row(d, static_cast<int>(ids[j] % El), g, in.weights[static_cast<size_t>(t * k + j)]));
      return lanes.size() == 1 ? lanes[0] : keep(round_sum(lanes, H, spec.reversed_levels & 1));
    };
    std::vector<const std::uint16_t*> inputs;
    for (const auto& b : in.bias) inputs.push_back(&b[static_cast<size_t>(t * H)]);
    if (spec.expand && !spec.multi) {
      for (int j = 0; j < k; ++j)
        if (ids[j] >= 0)
          inputs.push_back(expert_row(rank_of(spec, ids[j]), static_cast<int>(ids[j] % El), g, in.weights[static_cast<size_t>(t * k + j)]));
    } else {
      // Ranks by master lane.
      std::vector<std::pair<int, int>> ranks;  // (master lane, rank)
      std::set<int> seen;
      for (int j = k - 1; j >= 0; --j)
        if (ids[j] >= 0 && seen.insert(rank_of(spec, ids[j])).second) ranks.push_back({j, rank_of(spec, ids[j])});
      std::sort(ranks.begin(), ranks.end());
      if (spec.hybrid() && spec.multi) {
        std::vector<std::pair<int, int>> nodes;  // (node master lane, node)
        std::set<int> seen_nodes;
        for (int j = k - 1; j >= 0; --j)
          if (ids[j] >= 0 && seen_nodes.insert(node_of(spec, rank_of(spec, ids[j]))).second)
            nodes.push_back({j, node_of(spec, rank_of(spec, ids[j]))});
        std::sort(nodes.begin(), nodes.end());
        for (const auto& [lane, node] : nodes) {
          std::vector<const std::uint16_t*> members;
          for (const auto& [m, d] : ranks)
            if (node_of(spec, d) == node) members.push_back(rank_contribution(d));
          inputs.push_back(members.size() == 1 ? members[0] : keep(round_sum(members, H, spec.reversed_levels & 2)));
        }
      } else {
        for (const auto& [m, d] : ranks) inputs.push_back(rank_contribution(d));
      }
    }
    // Biases first, then the units in ascending key order (reversed: units descending, after the biases).
    if (spec.reversed_levels & 4) std::reverse(inputs.begin() + static_cast<std::ptrdiff_t>(in.bias.size()), inputs.end());
    const auto result = round_sum(inputs, H);
    std::copy(result.begin(), result.end(), out.x.begin() + static_cast<std::ptrdiff_t>(t) * H);
    if (spec.weights)
      for (int j = 0; j < k; ++j)
        if (ids[j] >= 0) out.weights[static_cast<size_t>(t * k + j)] = in.weights[static_cast<size_t>(t * k + j)] * weight_scale;
  }
  return out;
}

}  // namespace moe_ep::reference
