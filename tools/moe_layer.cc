#include "moe_layer.hh"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string_view>

#include "core/arith.hh"
#include "moe_ep/dtype.hpp"
#include "reference/logfmt_reference.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep::tools {
namespace {

// The one place where an expert's output is computed (shared by the run and the reference, so
// both perform the same FP32 operations): acc[h] += w * (x[h] * scale[h] + bias[h]).
void accumulate_expert(const float* x, const ExpertParams& params, std::int64_t expert, float weight, int hidden,
                       float* acc) {
  const float* s = params.scale.data_as<const float>() + expert * hidden;
  const float* b = params.bias.data_as<const float>() + expert * hidden;
  for (int h = 0; h < hidden; ++h) {
    const float value = x[h] * s[h] + b[h];
    const float weighted = weight * value;
    acc[h] += weighted;
  }
}

// One expert's unweighted output row, rounded to BF16 (low-latency mode).
void expert_row(const float* x, const ExpertParams& params, std::int64_t expert, int hidden, std::uint16_t* out) {
  const float* s = params.scale.data_as<const float>() + expert * hidden;
  const float* b = params.bias.data_as<const float>() + expert * hidden;
  for (int h = 0; h < hidden; ++h) {
    const float value = x[h] * s[h] + b[h];
    out[h] = reference::bf16_from_float(value);
  }
}

// Row `row` of BF16 or FP8 activations (with per-128 scales, any strides) as FP32.
void load_row(bool fp8, int H, const std::byte* x, const float* scales, std::int64_t scale_step, float* out) {
  static const std::vector<float> decoded = [] {
    std::vector<float> table(256);
    for (int code = 0; code < 256; ++code)
      table[static_cast<size_t>(code)] = static_cast<float>(reference::fp8_e4m3_value(static_cast<std::uint8_t>(code)));
    return table;
  }();
  if (!fp8) {
    const auto* in = reinterpret_cast<const std::uint16_t*>(x);
    for (int h = 0; h < H; ++h) out[h] = reference::float_from_bf16(in[h]);
    return;
  }
  const auto* q = reinterpret_cast<const std::uint8_t*>(x);
  for (int block = 0; block < H / 128; ++block) {
    const float scale = scales[block * scale_step];
    for (int h = block * 128; h < (block + 1) * 128; ++h) out[h] = decoded[q[h]] * scale;
  }
}

// One NVFP4 element as the consumer dequantizes it (docs/quantized-formats.md): e2m1(q) * fp32(sf) / gs
// (FP32 product, then quotient), or e2m1(q) * 2^(sf - 127) with UE8M0 scales.
float nvfp4_value(const LayerConfig& c, std::uint8_t code, std::uint8_t sf) {
  const float v = static_cast<float>(reference::e2m1_value(code));
  if (c.nvfp4_ue8m0) return std::ldexp(v, static_cast<int>(sf) - 127);
  return v * static_cast<float>(reference::fp8_e4m3_value(sf)) / c.nvfp4_global_scale;
}

// Row t of the received or local activations as FP32.
void load_row(const LayerConfig& config, const TensorView& x, const TensorView& scales, std::int64_t row, float* out) {
  const auto* data = static_cast<const std::byte*>(x.data()) + row * x.stride(0) * static_cast<std::int64_t>(element_size(x.dtype()));
  if (!config.fp8) return load_row(false, config.hidden, data, nullptr, 0, out);
  load_row(true, config.hidden, data, scales.data_as<const float>() + row * scales.stride(0), scales.stride(1), out);
}

void round_row(const float* acc, int hidden, std::uint16_t* out) {
  for (int h = 0; h < hidden; ++h) out[h] = reference::bf16_from_float(acc[h]);
}

// Sums BF16 rows in FP32 in order (first row as is) and rounds once; one row passes through.
std::vector<std::uint16_t> sum_rows(const std::vector<const std::uint16_t*>& rows, int hidden) {
  std::vector<std::uint16_t> out(static_cast<size_t>(hidden), 0);
  for (int h = 0; h < hidden && !rows.empty(); ++h) {
    float acc = reference::float_from_bf16(rows[0][h]);
    for (std::size_t i = 1; i < rows.size(); ++i) acc += reference::float_from_bf16(rows[i][h]);
    out[static_cast<size_t>(h)] = reference::bf16_from_float(acc);
  }
  return out;
}

}  // namespace

int LayerConfig::tokens_on(int rank) const { return tokens - (rank * 7) % (tokens / 8 + 1); }

void route(const LayerConfig& c, int rank, int n, Tensor& topk_idx, Tensor& topk_weights) {
  std::mt19937_64 rng(c.seed * 0x2545f4914f6cdd1dULL + static_cast<std::uint64_t>(rank) + 7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Expert popularity: Zipf over a seeded permutation (the same on every rank).
  std::vector<int> perm(static_cast<size_t>(c.experts));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(c.seed));
  std::vector<float> prior(static_cast<size_t>(c.experts));
  for (int i = 0; i < c.experts; ++i)
    prior[static_cast<size_t>(perm[static_cast<size_t>(i)])] = static_cast<float>(-c.skew * std::log(i + 1.0));
  topk_idx = Tensor::empty({n, c.topk}, DType::kInt64);
  topk_weights = Tensor::empty({n, c.topk}, DType::kFP32);
  std::vector<float> logits(static_cast<size_t>(c.experts));
  std::vector<int> order(static_cast<size_t>(c.experts));
  for (int t = 0; t < n; ++t) {
    for (int e = 0; e < c.experts; ++e) logits[static_cast<size_t>(e)] = prior[static_cast<size_t>(e)] + normal(rng);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + c.topk, order.end(),
                      [&](int a, int b2) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b2)]; });
    float total = 0.0f;
    for (int j = 0; j < c.topk; ++j)
      total += std::exp(logits[static_cast<size_t>(order[static_cast<size_t>(j)])] - logits[static_cast<size_t>(order[0])]);
    for (int j = 0; j < c.topk; ++j) {
      const int e = order[static_cast<size_t>(j)];
      topk_idx.data_as<std::int64_t>()[t * c.topk + j] = e;
      topk_weights.data_as<float>()[t * c.topk + j] =
          std::exp(logits[static_cast<size_t>(e)] - logits[static_cast<size_t>(order[0])]) / total;
    }
  }
}

RankBatch make_batch(const LayerConfig& c, int rank) {
  RankBatch b;
  b.rank = rank;
  const int n = c.tokens_on(rank);
  std::mt19937_64 rng(c.seed * 0x9e3779b97f4a7c15ULL + static_cast<std::uint64_t>(rank) + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  b.x = Tensor::empty({n, c.hidden}, DType::kBF16);
  for (std::int64_t i = 0; i < b.x.numel(); ++i) b.x.data_as<std::uint16_t>()[i] = reference::bf16_from_float(normal(rng));
  if (c.fp8) {  // per-128 scales amax * fp32(1/448), as the library's FP8 cast (moe_ep/convert.hpp)
    b.x_fp8 = Tensor::empty({n, c.hidden}, DType::kFP8E4M3);
    b.x_scales = Tensor::empty({n, c.hidden / 128}, DType::kFP32);
    for (int t = 0; t < n; ++t) {
      const reference::Fp8Row q =
          reference::quantize_row_fp8(b.x.data_as<const std::uint16_t>() + t * c.hidden, c.hidden, false, false);
      std::memcpy(b.x_fp8.data_as<std::uint8_t>() + t * c.hidden, q.codes.data(), q.codes.size());
      std::memcpy(b.x_scales.data_as<float>() + t * (c.hidden / 128), q.scales.data(), sizeof(std::uint32_t) * q.scales.size());
    }
  }
  if (c.nvfp4) {
    b.x_global_scale = Tensor::empty({}, DType::kFP32);
    *b.x_global_scale.data_as<float>() = c.nvfp4_global_scale;
  }
  route(c, rank, n, b.topk_idx, b.topk_weights);
  return b;
}

ExpertParams make_experts(const LayerConfig& c) {
  ExpertParams p{Tensor::empty({c.experts, c.hidden}, DType::kFP32), Tensor::empty({c.experts, c.hidden}, DType::kFP32)};
  std::mt19937_64 rng(c.seed + 12345);
  std::uniform_real_distribution<float> scale(0.5f, 1.5f), bias(-0.25f, 0.25f);
  const float shrink = c.logfmt ? 0.125f : 1.0f;
  for (std::int64_t i = 0; i < p.scale.numel(); ++i) {
    p.scale.data_as<float>()[i] = scale(rng) * shrink;
    p.bias.data_as<float>()[i] = bias(rng) * shrink;
  }
  return p;
}

namespace {

// Compact rows: row i = bf16(sum over its local lanes j, ascending, of w_j * f_e(x)).
Tensor experts_compact(const LayerConfig& c, const ExpertParams& params, int rank, const TensorView& recv_x,
                       const TensorView& scales, const TensorView& topk_idx, const TensorView& weights, std::int64_t real) {
  const int H = c.hidden, k = c.topk, El = c.experts / c.ranks;
  Tensor y = Tensor::zeros({recv_x.size(0), H}, DType::kBF16);
  std::vector<float> x(static_cast<size_t>(H)), acc(static_cast<size_t>(H));
  auto* out = y.data_as<std::uint16_t>();
  for (std::int64_t i = 0; i < real; ++i) {
    load_row(c, recv_x, scales, i, x.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < k; ++j) {
      const std::int64_t local = topk_idx.data_as<const std::int64_t>()[i * k + j];
      if (local < 0) continue;
      accumulate_expert(x.data(), params, std::int64_t{rank} * El + local, weights.data_as<const float>()[i * k + j], H,
                        acc.data());
    }
    round_row(acc.data(), H, out + i * H);
  }
  return y;
}

// Expanded rows: expert i's rows [start_i, start_i + count_i) = bf16(w_row * f_e(x)); padding 0.
Tensor experts_expanded(const LayerConfig& c, const ExpertParams& params, int rank, const TensorView& recv_x,
                        const TensorView& scales, const TensorView& weights, const std::vector<std::int64_t>& start,
                        const std::vector<std::int64_t>& count) {
  const int H = c.hidden, El = c.experts / c.ranks;
  Tensor y = Tensor::zeros({recv_x.size(0), H}, DType::kBF16);
  std::vector<float> x(static_cast<size_t>(H)), acc(static_cast<size_t>(H));
  auto* out = y.data_as<std::uint16_t>();
  for (int i = 0; i < El; ++i)
    for (std::int64_t row = start[static_cast<size_t>(i)]; row < start[static_cast<size_t>(i)] + count[static_cast<size_t>(i)]; ++row) {
      load_row(c, recv_x, scales, row, x.data());
      std::fill(acc.begin(), acc.end(), 0.0f);
      accumulate_expert(x.data(), params, std::int64_t{rank} * El + i, weights.data_as<const float>()[row], H, acc.data());
      round_row(acc.data(), H, out + row * H);
    }
  return y;
}

// The slab [El, rows, H]: expert i's first count_i rows = bf16(f_e(x)), unweighted.
// Row `row` of local expert i of an NVFP4 slab (storage [El, R*N, H/2] under the view
// [R*N, H/2, El]; scales in the 128 x 4 swizzled layout, docs/quantized-formats.md), dequantized.
void load_nvfp4_row(const LayerConfig& c, const TensorView& recv_x, const TensorView& sc, int i, std::int64_t row,
                    float* out) {
  const std::int64_t H = c.hidden, rows = recv_x.size(0), rk = H / 64;
  const auto* q = recv_x.data_as<const std::uint8_t>() + (i * rows + row) * (H / 2);
  const auto* s = static_cast<const std::uint8_t*>(sc.data()) + i * sc.stride(5) * static_cast<std::int64_t>(element_size(sc.dtype()));
  for (std::int64_t j = 0; j < H / 16; ++j) {
    const std::uint8_t sf = s[((row / 128) * rk + j / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + j % 4];
    for (std::int64_t e = j * 16; e < j * 16 + 16; ++e)
      out[e] = nvfp4_value(c, static_cast<std::uint8_t>(e % 2 ? q[e / 2] >> 4 : q[e / 2] & 15), sf);
  }
}

Tensor experts_slab(const LayerConfig& c, const ExpertParams& params, int rank, const TensorView& recv_x,
                    const TensorView& sc, const TensorView& counts) {
  const int H = c.hidden, El = c.experts / c.ranks;
  const std::int64_t slab = c.nvfp4 ? recv_x.size(0) : recv_x.size(1);
  // Only the valid rows are written (and read by combine): the rest of the slab stays untouched.
  Tensor y = Tensor::empty({El, slab, H}, DType::kBF16);
  std::vector<float> x(static_cast<size_t>(H));
  const std::int64_t es = static_cast<std::int64_t>(element_size(recv_x.dtype()));
  for (int i = 0; i < El; ++i)
    for (std::int64_t row = 0; row < counts.data_as<const std::int32_t>()[i]; ++row) {
      const auto* data = static_cast<const std::byte*>(recv_x.data()) + ((i * slab + row) * H) * es;
      if (c.nvfp4) {
        load_nvfp4_row(c, recv_x, sc, i, row, x.data());
      } else if (c.fp8) {
        load_row(true, H, data, sc.data_as<const float>() + i * sc.stride(0) + row * sc.stride(1), sc.stride(2), x.data());
      } else {
        load_row(false, H, data, nullptr, 0, x.data());
      }
      expert_row(x.data(), params, std::int64_t{rank} * El + i, H, y.data_as<std::uint16_t>() + (i * slab + row) * H);
    }
  return y;
}

}  // namespace

Tensor run_experts(const LayerConfig& c, const ExpertParams& params, int rank, const DispatchResult& r) {
  const EPHandle& h = *r.handle;
  if (!c.expand) {
    const auto& psum = h.psum_num_recv_tokens_per_scaleup_rank;
    return experts_compact(c, params, rank, r.recv_x, r.recv_x_scales, r.recv_topk_idx, r.recv_topk_weights,
                           psum.data_as<const std::int32_t>()[psum.size(0) - 1]);
  }
  // Expanded: expert i holds rows [start_i, start_i + count_i); start_i = align(psum[i-1]).
  const auto* psum = h.psum_num_recv_tokens_per_expert.data_as<const std::int32_t>();
  std::vector<std::int64_t> start, count;
  for (int i = 0; i < c.experts / c.ranks; ++i) {
    start.push_back(i == 0 ? 0 : core::round_up(psum[i - 1], c.alignment));
    count.push_back(psum[i] - start.back());
  }
  return experts_expanded(c, params, rank, r.recv_x, r.recv_x_scales, r.recv_topk_weights, start, count);
}

Tensor run_experts(const LayerConfig& c, const ExpertParams& params, int rank, const DispatchOutput& r) {
  switch (r.format) {
    case OutputFormat::kNormal:
      return experts_compact(c, params, rank, r.hidden_states, r.hidden_states_scale, r.topk_ids, r.topk_weights,
                             r.hidden_states.size(0));
    case OutputFormat::kV2Expanded:
    case OutputFormat::kHybridEp: {  // both: blocks per local expert, real rows first, then padding
      std::vector<std::int64_t> start, count;
      std::int64_t next = 0;
      for (std::size_t i = 0; i < r.num_recv_tokens_per_expert.size(); ++i) {
        start.push_back(next);
        count.push_back(r.masked_m.data_as<const std::int32_t>()[i]);
        next += r.num_recv_tokens_per_expert[i];
      }
      return experts_expanded(c, params, rank, r.hidden_states, r.hidden_states_scale, r.topk_weights, start, count);
    }
    case OutputFormat::kLowLatency:
      return experts_slab(c, params, rank, r.hidden_states, r.hidden_states_scale, r.masked_m);
  }
  return Tensor();
}

namespace {

// Every row of the batch cast to NVFP4 by the format's definition and dequantized, [N * H] FP32;
// the E2M1 rounding is MOE_EP_NVFP4_ROUNDING's (docs/env.md), as the library's.
std::vector<float> reference_nvfp4_rows(const LayerConfig& c, const RankBatch& b) {
  const int H = c.hidden;
  const char* rounding = std::getenv("MOE_EP_NVFP4_ROUNDING");
  const bool sm90 = rounding != nullptr && std::string_view(rounding) == "sm90";
  std::vector<float> rows(static_cast<size_t>(b.x.size(0) * H));
  for (std::int64_t t = 0; t < b.x.size(0); ++t) {
    const reference::Nvfp4Row q =
        reference::quantize_row_nvfp4(b.x.data_as<const std::uint16_t>() + t * H, H, c.nvfp4_global_scale, c.nvfp4_ue8m0, sm90);
    for (int e = 0; e < H; ++e) {
      const std::uint8_t byte = q.packed[static_cast<size_t>(e / 2)];
      rows[static_cast<size_t>(t * H + e)] =
          nvfp4_value(c, static_cast<std::uint8_t>(e % 2 ? byte >> 4 : byte & 15), q.scales[static_cast<size_t>(e / 16)]);
    }
  }
  return rows;
}

// Token t's input row in FP32 as the experts see it: dequantized from the wire format
// (`nvfp4_rows`: reference_nvfp4_rows with NVFP4).
void reference_input_row(const LayerConfig& c, const RankBatch& b, const std::vector<float>& nvfp4_rows, std::int64_t t,
                         float* x) {
  if (c.nvfp4) {
    std::memcpy(x, nvfp4_rows.data() + t * c.hidden, sizeof(float) * static_cast<size_t>(c.hidden));
  } else if (c.fp8) {
    load_row(c, b.x_fp8, b.x_scales, t, x);
  } else {
    load_row(c, b.x, TensorView(), t, x);
  }
}

// Expanded layouts: one BF16 row per selected lane, bf16(w * f(x)) (or bf16(w * bf16(f(x))) where
// the lanes are weighted after rounding); empty rows for unselected lanes.
std::vector<std::vector<std::uint16_t>> reference_lane_rows(const LayerConfig& c, const ExpertParams& params,
                                                            const float* x, const std::int64_t* ids, const float* w) {
  const int H = c.hidden, k = c.topk;
  std::vector<std::vector<std::uint16_t>> lane_rows(static_cast<size_t>(k));
  std::vector<float> acc(static_cast<size_t>(H));
  for (int j = 0; j < k && c.expand; ++j) {
    if (ids[j] < 0) continue;
    lane_rows[static_cast<size_t>(j)].resize(static_cast<size_t>(H));
    if (c.lanes_weighted_after_rounding) {  // bf16(w * bf16(f(x))): the dispatcher's V2 low-latency lanes
      std::vector<std::uint16_t> unweighted(static_cast<size_t>(H));
      expert_row(x, params, ids[j], H, unweighted.data());
      for (int h = 0; h < H; ++h)
        lane_rows[static_cast<size_t>(j)][static_cast<size_t>(h)] = reference::bf16_from_float(w[j] * reference::float_from_bf16(unweighted[static_cast<size_t>(h)]));
      continue;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    accumulate_expert(x, params, ids[j], w[j], H, acc.data());
    round_row(acc.data(), H, lane_rows[static_cast<size_t>(j)].data());
  }
  return lane_rows;
}

// HybridEP's order (docs/hybrid-ep.md, "Reduction") of the units of a token of `source`, given
// the receiving ranks ascending: the source's node's ranks, each a term of the final sum; then each
// other node, source node - 1, - 2, ... wrapping, as the BF16 sum of its ranks.
std::vector<const std::uint16_t*> hybrid_ep_units(const LayerConfig& c, int source, const std::vector<int>& receivers,
                                                  const std::function<const std::uint16_t*(int)>& contribution,
                                                  std::vector<std::vector<std::uint16_t>>& storage) {
  const int per_node = c.ranks / c.scaleout, home = source / per_node;
  std::vector<const std::uint16_t*> units;
  for (int step = 0; step < c.scaleout; ++step) {
    const int node = ((home - step) % c.scaleout + c.scaleout) % c.scaleout;
    std::vector<const std::uint16_t*> members;
    for (int d : receivers)
      if (d / per_node == node) members.push_back(contribution(d));
    if (step == 0 || members.size() <= 1) {
      units.insert(units.end(), members.begin(), members.end());
    } else {
      storage.push_back(sum_rows(members, c.hidden));
      units.push_back(storage.back().data());
    }
  }
  return units;
}

}  // namespace

Tensor reference_output(const LayerConfig& c, const ExpertParams& params, const RankBatch& b) {
  const int H = c.hidden, k = c.topk, El = c.experts / c.ranks;
  const int nodes = c.allow_hybrid ? c.scaleout : 1;
  const int ranks_per_node = c.ranks / nodes;
  const std::int64_t n = b.x.size(0);
  Tensor out = Tensor::empty({n, H}, DType::kBF16);
  std::vector<float> x(static_cast<size_t>(H)), acc(static_cast<size_t>(H));
  const std::vector<float> nvfp4_rows = c.nvfp4 ? reference_nvfp4_rows(c, b) : std::vector<float>();
  for (std::int64_t t = 0; t < n; ++t) {
    reference_input_row(c, b, nvfp4_rows, t, x.data());
    const std::int64_t* ids = b.topk_idx.data_as<const std::int64_t>() + t * k;
    const float* w = b.topk_weights.data_as<const float>() + t * k;
    auto rank_of = [&](int j) { return static_cast<int>(ids[j] / El); };
    // One BF16 row per lane (expanded) or per destination rank (compact).
    const auto lane_rows = reference_lane_rows(c, params, x.data(), ids, w);
    std::vector<int> master(static_cast<size_t>(c.ranks), -1);
    for (int j = 0; j < k; ++j)
      if (ids[j] >= 0) master[static_cast<size_t>(rank_of(j))] = j;  // highest lane wins
    auto rank_row = [&](int d) {
      std::vector<std::uint16_t> row(static_cast<size_t>(H));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int j = 0; j < k; ++j)
        if (ids[j] >= 0 && rank_of(j) == d) accumulate_expert(x.data(), params, ids[j], w[j], H, acc.data());
      round_row(acc.data(), H, row.data());
      return row;
    };
    std::vector<std::vector<std::uint16_t>> storage;
    storage.reserve(static_cast<size_t>(4 * k));
    auto contribution = [&](int d) -> const std::uint16_t* {  // rank d's unit
      if (!c.expand) {
        storage.push_back(rank_row(d));
        return storage.back().data();
      }
      std::vector<const std::uint16_t*> lanes;
      for (int j = 0; j < k; ++j)
        if (ids[j] >= 0 && rank_of(j) == d) lanes.push_back(lane_rows[static_cast<size_t>(j)].data());
      if (lanes.size() == 1) return lanes[0];
      storage.push_back(sum_rows(lanes, H));
      return storage.back().data();
    };
    std::vector<std::pair<int, int>> by_master;  // (master lane, rank)
    for (int d = 0; d < c.ranks; ++d)
      if (master[static_cast<size_t>(d)] >= 0) by_master.push_back({master[static_cast<size_t>(d)], d});
    std::sort(by_master.begin(), by_master.end());
    std::vector<const std::uint16_t*> units;
    if (c.hybrid_ep_order) {
      std::vector<int> receivers;
      for (int d = 0; d < c.ranks; ++d)
        if (master[static_cast<size_t>(d)] >= 0) receivers.push_back(d);
      units = hybrid_ep_units(c, b.rank, receivers, contribution, storage);
    } else if (c.expand && !c.multi) {
      for (int j = 0; j < k; ++j)
        if (ids[j] >= 0) units.push_back(lane_rows[static_cast<size_t>(j)].data());
    } else if (nodes > 1 && c.multi) {
      std::vector<int> node_master(static_cast<size_t>(nodes), -1);
      for (int j = 0; j < k; ++j)
        if (ids[j] >= 0) node_master[static_cast<size_t>(rank_of(j) / ranks_per_node)] = j;
      std::vector<std::pair<int, int>> by_node;
      for (int g = 0; g < nodes; ++g)
        if (node_master[static_cast<size_t>(g)] >= 0) by_node.push_back({node_master[static_cast<size_t>(g)], g});
      std::sort(by_node.begin(), by_node.end());
      for (const auto& [lane, g] : by_node) {
        std::vector<const std::uint16_t*> members;
        for (const auto& [m, d] : by_master)
          if (d / ranks_per_node == g) members.push_back(contribution(d));
        if (members.size() == 1) {
          units.push_back(members[0]);
        } else {
          storage.push_back(sum_rows(members, H));
          units.push_back(storage.back().data());
        }
      }
    } else {
      for (const auto& [m, d] : by_master) units.push_back(contribution(d));
    }
    const auto final_row = sum_rows(units, H);
    std::memcpy(out.data_as<std::uint16_t>() + t * H, final_row.data(), sizeof(std::uint16_t) * static_cast<size_t>(H));
  }
  return out;
}

}  // namespace moe_ep::tools

namespace moe_ep::tools {

Tensor run_experts_low_latency(const LayerConfig& c, const ExpertParams& params, int rank,
                               const LowLatencyDispatchResult& r) {
  return experts_slab(c, params, rank, r.recv_x, r.recv_x_scales, r.packed_recv_count);
}

Tensor reference_low_latency_output(const LayerConfig& c, const ExpertParams& params, const RankBatch& b) {
  const int H = c.hidden, k = c.topk;
  const std::int64_t n = b.x.size(0);
  Tensor out = Tensor::empty({n, H}, DType::kBF16);
  std::vector<float> x(static_cast<size_t>(H)), acc(static_cast<size_t>(H)), lane(static_cast<size_t>(H));
  std::vector<std::uint16_t> row(static_cast<size_t>(H));
  const std::vector<float> nvfp4_rows = c.nvfp4 ? reference_nvfp4_rows(c, b) : std::vector<float>();
  for (std::int64_t t = 0; t < n; ++t) {
    reference_input_row(c, b, nvfp4_rows, t, x.data());
    bool first = true;
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = b.topk_idx.data_as<const std::int64_t>()[t * k + j];
      if (e < 0) continue;
      expert_row(x.data(), params, e, H, row.data());
      if (c.logfmt) {
        lane = reference::logfmt_decode(reference::logfmt_encode(row.data(), H), H);
      } else {
        for (int h = 0; h < H; ++h) lane[static_cast<size_t>(h)] = reference::float_from_bf16(row[static_cast<size_t>(h)]);
      }
      const float w = b.topk_weights.data_as<const float>()[t * k + j];
      for (int h = 0; h < H; ++h) {
        const float product = w * lane[static_cast<size_t>(h)];
        acc[static_cast<size_t>(h)] = first ? product : acc[static_cast<size_t>(h)] + product;
      }
      first = false;
    }
    for (int h = 0; h < H; ++h) out.data_as<std::uint16_t>()[t * H + h] = first ? 0 : reference::bf16_from_float(acc[static_cast<size_t>(h)]);
  }
  return out;
}

}  // namespace moe_ep::tools
