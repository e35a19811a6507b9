#include "support/legacy_harness.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "moe_ep/legacy_buffer.hpp"
#include "reference/numeric_reference.hh"

namespace moe_ep::testing {
namespace {

using reference::CaseSpec;
using reference::RankInputs;

constexpr float kWeightScale = 2.0f;

bool token_on_rank(const CaseSpec& s, const RankInputs& in, int t, int d) {
  for (int j = 0; j < s.k; ++j) {
    const std::int64_t id = in.topk[static_cast<size_t>(t * s.k + j)];
    if (id >= 0 && id / s.experts_per_rank() == d) return true;
  }
  return false;
}

// Rows received from each source and the recv_x / recv_x_scales of `res` against them.
void check_rows(const CaseSpec& spec, const std::vector<RankInputs>& all, const reference::RefDispatch& ref,
                const LegacyDispatchResult& res, const std::string& what, std::vector<std::string>& bad) {
  const int rb = spec.row_bytes();
  for (std::size_t i = 0; i < ref.rows.size(); ++i) {
    const auto& row = ref.rows[i];
    const RankInputs& src = all[static_cast<size_t>(row.source)];
    if (std::memcmp(static_cast<const char*>(res.recv_x.data()) + static_cast<std::int64_t>(i) * rb,
                    &src.x[static_cast<size_t>(row.token) * rb], static_cast<size_t>(rb)) != 0)
      bad.push_back(fmt::format("{}recv_x row {} is not rank {} token {}", what, i, row.source, row.token));
    for (int p = 0; p < spec.scale_cols && spec.fp8; ++p)
      if (res.recv_x_scales.data_as<std::uint32_t>()[static_cast<std::int64_t>(i) * res.recv_x_scales.stride(0) +
                                                     p * res.recv_x_scales.stride(1)] !=
          src.scales[static_cast<size_t>(row.token * spec.scale_cols + p)])
        bad.push_back(fmt::format("{}recv_x_scales row {}", what, i));
  }
}

// The mismatches of one rank, each prefixed with the rank; at most 20 are kept.
class Failures {
 public:
  explicit Failures(int rank) : rank_(rank) {}
  void operator()(const std::string& what) {
    if (list_.size() < 20) list_.push_back(fmt::format("[rank {}] {}", rank_, what));
  }
  std::vector<std::string>& list() { return list_; }

 private:
  int rank_;
  std::vector<std::string> list_;
};

// What every step of one case reads: the spec, the inputs of all ranks, this rank's views of its
// own, and the configs of dispatch and combine.
struct LegacyCase {
  const CaseSpec& spec;
  const LegacyRunOptions& opt;
  int me;
  DType x_dtype;
  std::vector<RankInputs>& all;
  RankInputs& in;
  std::int64_t n;
  TensorView x, scales, topk, weights;
  std::optional<Config> dispatch_config, combine_config;
};

LegacyCase make_case(const CaseSpec& spec, const LegacyRunOptions& opt, int me, DType x_dtype,
                     std::vector<RankInputs>& all) {
  RankInputs& in = all[static_cast<size_t>(me)];
  const std::int64_t n = in.num_tokens;
  LegacyCase c{.spec = spec,
               .opt = opt,
               .me = me,
               .x_dtype = x_dtype,
               .all = all,
               .in = in,
               .n = n,
               .x = TensorView(in.x.data(), x_dtype, {n, spec.hidden}),
               .scales = TensorView(in.scales.data(), DType::kFP32, {n, spec.scale_cols}),
               .topk = TensorView(in.topk.data(), DType::kInt64, {n, spec.k}),
               .weights = TensorView(in.weights.data(), DType::kFP32, {n, spec.k})};
  if (opt.num_sms > 0) {
    c.dispatch_config = Buffer::get_dispatch_config(spec.ranks);
    c.dispatch_config->num_sms = opt.num_sms;
    c.combine_config = Buffer::get_combine_config(spec.ranks);
    c.combine_config->num_sms = opt.num_sms;
  }
  return c;
}

// Layout against brute force.
void check_layout(const LegacyCase& c, const DispatchLayout& layout, Failures& fail) {
  const CaseSpec& spec = c.spec;
  const int R = spec.ranks;
  for (int d = 0; d < R; ++d) {
    int count = 0;
    for (int t = 0; t < c.n; ++t) {
      const bool hit = token_on_rank(spec, c.in, t, d);
      count += hit;
      if (layout.is_token_in_rank.data_as<std::uint8_t>()[t * R + d] != hit) fail(fmt::format("is_token_in_rank[{}, {}]", t, d));
    }
    if (layout.num_tokens_per_rank.data_as<std::int32_t>()[d] != count) fail(fmt::format("num_tokens_per_rank[{}]", d));
  }
  for (int e = 0; e < spec.num_experts; ++e) {
    int count = 0;
    for (auto id : c.in.topk) count += id == e;
    if (layout.num_tokens_per_expert.data_as<std::int32_t>()[e] != count) fail(fmt::format("num_tokens_per_expert[{}]", e));
  }
  if ((spec.scaleout > 1) != layout.num_tokens_per_rdma_rank.defined()) fail("num_tokens_per_rdma_rank presence");
}

// The first dispatch: the layout's counts, topk ids and weights when the options pass them.
LegacyDispatchResult first_dispatch(Buffer& buffer, const LegacyCase& c, const DispatchLayout& layout) {
  LegacyDispatchArgs args{.x = c.x,
                          .num_tokens_per_rank = layout.num_tokens_per_rank,
                          .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                          .is_token_in_rank = layout.is_token_in_rank,
                          .num_tokens_per_expert = layout.num_tokens_per_expert,
                          .expert_alignment = c.spec.alignment,
                          .num_worst_tokens = c.opt.num_worst_tokens,
                          .config = c.dispatch_config,
                          .async_finish = c.opt.async};
  if (c.opt.with_topk) {
    args.topk_idx = c.topk;
    if (c.spec.weights) args.topk_weights = c.weights;
  }
  if (c.spec.fp8) args.x_scales = c.scales;
  LegacyDispatchResult res = buffer.dispatch(args);
  res.event.wait();
  return res;
}

// recv_x's dtype and rows, the per-expert counts, the received rows, topk ids and weights, the tail.
void check_received(const LegacyCase& c, const reference::RefDispatch& ref, const LegacyDispatchResult& res,
                    std::int64_t rows_out, Failures& fail) {
  const CaseSpec& spec = c.spec;
  const int k = spec.k, El = spec.experts_per_rank();
  const auto M = static_cast<std::int64_t>(ref.rows.size());
  if (res.recv_x.size(0) != rows_out) fail(fmt::format("recv_x has {} rows, expected {}", res.recv_x.size(0), rows_out));
  std::vector<int> aligned;
  for (int i = 0; i < El; ++i) aligned.push_back((ref.unaligned[static_cast<size_t>(i)] + spec.alignment - 1) / spec.alignment * spec.alignment);
  if (c.opt.num_worst_tokens > 0 ? !res.num_recv_tokens_per_expert_list.empty() : res.num_recv_tokens_per_expert_list != aligned)
    fail("num_recv_tokens_per_expert_list");
  {
    std::vector<std::string> rows_bad;
    check_rows(spec, c.all, ref, res, "", rows_bad);
    for (auto& b : rows_bad) fail(b);
  }
  for (std::int64_t i = 0; i < M && c.opt.with_topk; ++i) {
    const auto& row = ref.rows[static_cast<size_t>(i)];
    const RankInputs& src = c.all[static_cast<size_t>(row.source)];
    for (int j = 0; j < k; ++j) {
      if (res.recv_topk_idx.data_as<std::int64_t>()[i * k + j] != row.local_ids[static_cast<size_t>(j)])
        fail(fmt::format("recv_topk_idx[{}, {}]", i, j));
      const float expected = row.local_ids[static_cast<size_t>(j)] >= 0 ? src.weights[static_cast<size_t>(row.token * k + j)] : 0.0f;
      if (spec.weights && res.recv_topk_weights.data_as<float>()[i * k + j] != expected)
        fail(fmt::format("recv_topk_weights[{}, {}] = {}, expected {} (0 where not local)", i, j,
                         res.recv_topk_weights.data_as<float>()[i * k + j], expected));
    }
  }
  if (!c.opt.with_topk && res.recv_topk_idx.defined()) fail("recv_topk_idx must be undefined without topk_idx");
  for (std::int64_t i = M; i < rows_out; ++i)
    for (int j = 0; j < k; ++j)
      if (res.recv_topk_idx.data_as<std::int64_t>()[i * k + j] != -1) fail(fmt::format("tail recv_topk_idx row {}", i));
}

// Handle fields (docs/legacy.md §3), each from its definition: channels, source indices, the
// rank prefix matrix and the global prefix sum over sources.
void check_handle_prefixes(const LegacyCase& c, const reference::RefDispatch& ref, const LegacyHandle& h, Failures& fail) {
  const CaseSpec& spec = c.spec;
  const int R = spec.ranks, C = h.num_channels;
  const auto M = static_cast<std::int64_t>(ref.rows.size());
  if (C != std::max(1, (c.opt.num_sms > 0 ? c.opt.num_sms : Buffer::get_dispatch_config(R).num_sms) / 2))
    fail(fmt::format("num_channels = {}", C));
  for (std::int64_t i = 0; i < M; ++i)
    if (h.recv_src_idx.data_as<std::int32_t>()[i] != ref.rows[static_cast<size_t>(i)].token) fail(fmt::format("recv_src_idx[{}]", i));
  for (int d = 0; d < R; ++d) {  // every column: tokens sources 0..s sent to rank d
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      for (int t = 0; t < c.all[static_cast<size_t>(s)].num_tokens; ++t) acc += token_on_rank(spec, c.all[static_cast<size_t>(s)], t, d);
      if (h.rank_prefix_matrix.data_as<std::int32_t>()[s * R + d] != acc)
        fail(fmt::format("rank_prefix_matrix[{}, {}] = {}, expected {}", s, d, h.rank_prefix_matrix.data_as<std::int32_t>()[s * R + d], acc));
    }
  }
  int acc = 0;
  for (int s = 0; s < R; ++s) {
    acc += ref.per_source[static_cast<size_t>(s)];
    if (h.recv_gbl_rank_prefix_sum.data_as<std::int32_t>()[s] != acc) fail(fmt::format("recv_gbl_rank_prefix_sum[{}]", s));
  }
}

// Channels are contiguous ranges of ceil(N / C) tokens of their rank.
int channel_of(int token, int tokens, int C) { return token / std::max(1, (tokens + C - 1) / C); }

// send_head and channel_prefix_matrix of the tokens this rank sends.
void check_send_channels(const LegacyCase& c, const DispatchLayout& layout, const LegacyHandle& h, Failures& fail) {
  const int R = c.spec.ranks, C = h.num_channels;
  std::vector<int> next(static_cast<size_t>(R), 0);
  std::vector<int> channel_counts(static_cast<size_t>(R) * C, 0);
  for (int t = 0; t < c.n; ++t)
    for (int d = 0; d < R; ++d) {
      const bool sent = layout.is_token_in_rank.data_as<std::uint8_t>()[t * R + d];
      const int expected = sent ? next[static_cast<size_t>(d)]++ : -1;
      if (h.send_head.data_as<std::int32_t>()[t * R + d] != expected) fail(fmt::format("send_head[{}, {}]", t, d));
      if (sent) ++channel_counts[static_cast<size_t>(d) * C + channel_of(t, static_cast<int>(c.n), C)];
    }
  for (int d = 0; d < R; ++d) {
    int sum = 0;
    for (int ch = 0; ch < C; ++ch) {
      sum += channel_counts[static_cast<size_t>(d) * C + ch];
      if (h.channel_prefix_matrix.data_as<std::int32_t>()[d * C + ch] != sum) fail(fmt::format("channel_prefix_matrix[{}, {}]", d, ch));
    }
  }
}

// recv_channel_prefix_matrix[s][c]: where channel c of source s starts within the rows from s
// (exclusive prefix over the source's channels of the tokens it sent here).
void check_recv_channels(const LegacyCase& c, const LegacyHandle& h, Failures& fail) {
  const int R = c.spec.ranks, C = h.num_channels;
  if (h.recv_channel_prefix_matrix.ndim() != 2 || h.recv_channel_prefix_matrix.size(0) != R ||
      h.recv_channel_prefix_matrix.size(1) != C || h.recv_channel_prefix_matrix.dtype() != DType::kInt32) {
    fail(fmt::format("recv_channel_prefix_matrix has shape {}, expected int32 [{}, {}]", h.recv_channel_prefix_matrix.describe(), R, C));
    return;
  }
  for (int s = 0; s < R; ++s) {
    const RankInputs& src = c.all[static_cast<size_t>(s)];
    std::vector<int> per_channel(static_cast<size_t>(C), 0);
    for (int t = 0; t < src.num_tokens; ++t)
      if (token_on_rank(c.spec, src, t, c.me)) ++per_channel[static_cast<size_t>(channel_of(t, src.num_tokens, C))];
    int start = 0;
    for (int ch = 0; ch < C; ++ch) {
      const int got = h.recv_channel_prefix_matrix.data_as<std::int32_t>()[s * C + ch];
      if (got != start) fail(fmt::format("recv_channel_prefix_matrix[{}, {}] = {}, expected {}", s, ch, got, start));
      start += per_channel[static_cast<size_t>(ch)];
    }
  }
}

// recv_rdma_rank_prefix_sum[node]: inclusive prefix over source nodes of the tokens this rank
// forwards, i.e. those of the source with this rank's scale-up index on that node that have an
// expert on this rank's node; undefined on one node.
void check_rdma_prefix(const LegacyCase& c, const LegacyHandle& h, Failures& fail) {
  const CaseSpec& spec = c.spec;
  const int R = spec.ranks, me = c.me;
  if (spec.scaleout <= 1) {
    if (h.recv_rdma_rank_prefix_sum.defined()) fail("recv_rdma_rank_prefix_sum must be undefined on one node");
    return;
  }
  const int per_node = R / spec.scaleout, my_node = me / per_node;
  if (!h.recv_rdma_rank_prefix_sum.defined() || h.recv_rdma_rank_prefix_sum.numel() != spec.scaleout) {
    fail(fmt::format("recv_rdma_rank_prefix_sum has shape {}, expected [{}]",
                     h.recv_rdma_rank_prefix_sum.defined() ? h.recv_rdma_rank_prefix_sum.describe() : "undefined", spec.scaleout));
    return;
  }
  int forwarded = 0;
  for (int node = 0; node < spec.scaleout; ++node) {
    const RankInputs& src = c.all[static_cast<size_t>(node * per_node + me % per_node)];
    for (int t = 0; t < src.num_tokens; ++t) {
      bool to_my_node = false;
      for (int d = my_node * per_node; d < (my_node + 1) * per_node; ++d) to_my_node |= token_on_rank(spec, src, t, d);
      forwarded += to_my_node;
    }
    const int got = h.recv_rdma_rank_prefix_sum.data_as<std::int32_t>()[node];
    if (got != forwarded) fail(fmt::format("recv_rdma_rank_prefix_sum[{}] = {}, expected {}", node, got, forwarded));
  }
}

// A cached dispatch of the same x with the first call's handle returns only x, the same rows.
void check_cached_replay(Buffer& buffer, const LegacyCase& c, const LegacyDispatchResult& res, std::int64_t M, Failures& fail) {
  LegacyDispatchArgs again{.x = c.x, .handle = res.handle, .config = c.dispatch_config, .async_finish = c.opt.async};
  if (c.spec.fp8) again.x_scales = c.scales;
  LegacyDispatchResult cached = buffer.dispatch(again);
  cached.event.wait();
  if (cached.handle || cached.recv_topk_idx.defined()) fail("cached dispatch returns only x");
  if (cached.recv_x.size(0) != res.recv_x.size(0) ||
      std::memcmp(cached.recv_x.data(), res.recv_x.data(), static_cast<size_t>(M * c.spec.row_bytes())) != 0)
    fail("cached recv_x differs");
}

// New x and scales for the same routing: the handle's layout places them.
void check_replay_with_new_inputs(Buffer& buffer, const LegacyCase& c, const LegacyDispatchResult& res,
                                  std::int64_t rows_out, Failures& fail) {
  const CaseSpec& spec = c.spec;
  CaseSpec fresh_spec = spec;
  fresh_spec.seed = spec.seed * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
  std::vector<RankInputs> fresh;
  for (int r = 0; r < spec.ranks; ++r) {
    fresh.push_back(reference::make_inputs(fresh_spec, r));
    fresh.back().topk = c.all[static_cast<size_t>(r)].topk;
  }
  RankInputs& mine = fresh[static_cast<size_t>(c.me)];
  LegacyDispatchArgs again{.x = TensorView(mine.x.data(), c.x_dtype, {c.n, spec.hidden}),
                           .handle = res.handle,
                           .config = c.dispatch_config,
                           .async_finish = c.opt.async};
  if (spec.fp8) again.x_scales = TensorView(mine.scales.data(), DType::kFP32, {c.n, spec.scale_cols});
  LegacyDispatchResult replay = buffer.dispatch(again);
  replay.event.wait();
  if (replay.recv_x.size(0) != rows_out) fail(fmt::format("cached dispatch with new x: {} rows", replay.recv_x.size(0)));
  std::vector<std::string> rows_bad;
  check_rows(spec, fresh, reference::reference_dispatch(spec, fresh, c.me), replay, "cached dispatch with new x: ", rows_bad);
  for (auto& b : rows_bad) fail(b);
}

// Combine routed by is_token_in_rank alone: contributions in ascending rank order (per node first
// across nodes), FP32 sums rounded once per level. Writes the expected rows into `expected_x`.
void unrouted_combine_reference(const LegacyCase& c, const DispatchLayout& layout, std::vector<std::uint16_t>& expected_x) {
  const CaseSpec& spec = c.spec;
  const int R = spec.ranks, H = spec.hidden, me = c.me;
  auto sum = [&](const std::vector<std::vector<std::uint16_t>>& rows) {
    std::vector<std::uint16_t> out(static_cast<size_t>(H), 0);
    for (int hh = 0; hh < H && !rows.empty(); ++hh) {
      float a = reference::float_from_bf16(rows[0][static_cast<size_t>(hh)]);
      for (std::size_t r = 1; r < rows.size(); ++r) a += reference::float_from_bf16(rows[r][static_cast<size_t>(hh)]);
      out[static_cast<size_t>(hh)] = rows.size() == 1 ? rows[0][static_cast<size_t>(hh)] : reference::bf16_from_float(a);
    }
    return out;
  };
  const int per_node = R / spec.scaleout;
  for (std::int64_t t = 0; t < c.n; ++t) {
    std::vector<std::vector<std::uint16_t>> units;
    for (const auto& b : c.in.bias) units.emplace_back(b.begin() + t * H, b.begin() + (t + 1) * H);
    for (int node = 0; node < spec.scaleout; ++node) {
      std::vector<std::vector<std::uint16_t>> members;
      for (int d = node * per_node; d < (node + 1) * per_node; ++d) {
        if (!layout.is_token_in_rank.data_as<std::uint8_t>()[t * R + d]) continue;
        std::vector<std::uint16_t> row(static_cast<size_t>(H));
        for (int hh = 0; hh < H; ++hh) row[static_cast<size_t>(hh)] = spec.value(d, -1, me * spec.max_tokens + static_cast<int>(t), hh);
        members.push_back(row);
      }
      if (members.empty()) continue;
      if (spec.scaleout > 1) {
        units.push_back(sum(members));
      } else {
        for (auto& m : members) units.push_back(m);
      }
    }
    const auto row = sum(units);
    std::copy(row.begin(), row.end(), expected_x.begin() + t * H);
  }
}

// Combine: expert outputs depend on (rank, source token) so misrouting shows.
void check_combine(Buffer& buffer, const LegacyCase& c, const DispatchLayout& layout, const reference::RefDispatch& ref,
                   const LegacyDispatchResult& res, std::int64_t rows_out, Failures& fail) {
  const CaseSpec& spec = c.spec;
  const int k = spec.k, H = spec.hidden, me = c.me;
  const auto M = static_cast<std::int64_t>(ref.rows.size());
  Tensor y = Tensor::empty({rows_out, H}, DType::kBF16);
  for (std::int64_t i = 0; i < rows_out * H; ++i) y.data_as<std::uint16_t>()[i] = 0x7fc1;
  for (std::int64_t i = 0; i < M; ++i) {
    const auto& row = ref.rows[static_cast<size_t>(i)];
    for (int hh = 0; hh < H; ++hh)
      y.data_as<std::uint16_t>()[i * H + hh] = spec.value(me, -1, row.source * spec.max_tokens + row.token, hh);
  }
  Tensor y_weights;
  LegacyCombineArgs cargs{.x = y, .handle = res.handle, .config = c.combine_config, .async_finish = c.opt.async};
  if (c.opt.with_topk && spec.weights) {
    y_weights = Tensor::empty({rows_out, k}, DType::kFP32);
    for (std::int64_t i = 0; i < rows_out * k; ++i) y_weights.data_as<float>()[i] = res.recv_topk_weights.data_as<float>()[i] * kWeightScale;
    cargs.topk_weights = y_weights;
  }
  for (auto& b : c.in.bias) cargs.bias.push_back(TensorView(b.data(), DType::kBF16, {c.n, H}));
  CombineResult combined = buffer.combine(cargs);
  combined.event.wait();
  auto expected = reference::reference_combine(spec, c.all, me, kWeightScale);
  if (!c.opt.with_topk) unrouted_combine_reference(c, layout, expected.x);
  for (std::int64_t t = 0; t < c.n; ++t) {
    if (std::memcmp(combined.combined_x.data_as<std::uint16_t>() + t * H, &expected.x[static_cast<size_t>(t * H)],
                    sizeof(std::uint16_t) * static_cast<size_t>(H)) != 0)
      fail(fmt::format("combined_x[{}] differs", t));
    if (c.opt.with_topk && spec.weights)
      for (int j = 0; j < k; ++j)
        if (combined.combined_topk_weights.data_as<float>()[t * k + j] != expected.weights[static_cast<size_t>(t * k + j)])
          fail(fmt::format("combined_topk_weights[{}, {}]", t, j));
  }
}

}  // namespace

CaseSpec legacy_reference_spec(CaseSpec spec) {
  spec.expand = false;
  spec.allow_hybrid = true;
  spec.multi = true;
  return spec;
}

BufferConfig deepep_hint_config(std::int64_t hidden_bytes, int num_ranks) {
  BufferConfig config{.num_cpu_timeout_secs = 60};
  for (const Config& c : {Buffer::get_dispatch_config(num_ranks), Buffer::get_combine_config(num_ranks)}) {
    config.num_nvl_bytes = std::max(config.num_nvl_bytes, c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks));
    config.num_rdma_bytes = std::max(config.num_rdma_bytes, c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks));
  }
  return config;
}

std::vector<std::string> run_legacy_case(Group& g, const CaseSpec& case_spec, const LegacyRunOptions& opt) {
  // DeepEP sizes rows of at least 2 bytes per element (its tests: hidden x max(element size, 2)).
  const std::int64_t hidden_bytes = std::int64_t{case_spec.hidden} * std::max(case_spec.row_bytes() / case_spec.hidden, 2);
  Buffer buffer(g, opt.deepep_hints ? deepep_hint_config(hidden_bytes, case_spec.ranks)
                                    : BufferConfig{.num_rdma_bytes = 4 << 20, .num_cpu_timeout_secs = 60});
  return run_legacy_case_on(buffer, g, case_spec, opt);
}

std::vector<std::string> run_legacy_case_on(Buffer& buffer, Group& g, const CaseSpec& case_spec,
                                            const LegacyRunOptions& opt) {
  Failures fail(g.rank());
  const CaseSpec spec = legacy_reference_spec(case_spec);
  const int me = g.rank();
  const DType x_dtype = opt.payload_dtype ? *opt.payload_dtype : spec.fp8 ? DType::kFP8E4M3 : DType::kBF16;
  if (opt.payload_dtype && static_cast<int>(element_size(x_dtype)) != spec.payload_element_bytes) {
    fail(fmt::format("the case's payload_element_bytes {} is not the size of {}", spec.payload_element_bytes,
                     dtype_name(x_dtype)));
    return std::move(fail.list());
  }
  std::vector<RankInputs> all = reference::make_all_inputs(spec);
  const LegacyCase c = make_case(spec, opt, me, x_dtype, all);

  DispatchLayout layout = buffer.get_dispatch_layout(c.topk, spec.num_experts);
  check_layout(c, layout, fail);
  LegacyDispatchResult res = first_dispatch(buffer, c, layout);
  if (res.recv_x.dtype() != x_dtype)
    fail(fmt::format("recv_x has dtype {}, x has {}", dtype_name(res.recv_x.dtype()), dtype_name(x_dtype)));
  const auto ref = reference::reference_dispatch(spec, all, me);
  const auto M = static_cast<std::int64_t>(ref.rows.size());
  const std::int64_t rows_out = opt.num_worst_tokens > 0 ? opt.num_worst_tokens : M;
  check_received(c, ref, res, rows_out, fail);

  const LegacyHandle& h = *res.handle;
  check_handle_prefixes(c, ref, h, fail);
  check_send_channels(c, layout, h, fail);
  check_recv_channels(c, h, fail);
  check_rdma_prefix(c, h, fail);

  if (opt.cached) check_cached_replay(buffer, c, res, M, fail);
  if (opt.cached && opt.cached_new_inputs) check_replay_with_new_inputs(buffer, c, res, rows_out, fail);
  check_combine(buffer, c, layout, ref, res, rows_out, fail);
  return std::move(fail.list());
}

RankProblems run_legacy_case_in_process(const CaseSpec& spec, const LegacyRunOptions& options) {
  return collect_on_ranks(spec.ranks, {.num_scaleout = spec.scaleout},
                          [&](Group& g, std::vector<std::string>& problems) { problems = run_legacy_case(g, spec, options); });
}

void expect_legacy_case(const CaseSpec& spec, const LegacyRunOptions& options) {
  report_problems(run_legacy_case_in_process(spec, options), {.context = describe(spec, options)});
}

LegacyCalls::LegacyCalls(const CaseSpec& spec, const LegacyRunOptions& options, int rank)
    : spec_(legacy_reference_spec(spec)), options_(options), rank_(rank), all_(reference::make_all_inputs(spec_)),
      ref_(reference::reference_dispatch(spec_, all_, rank)) {}

LegacyCalls::Dispatched LegacyCalls::dispatch(Buffer& buffer, std::vector<std::string>& problems) {
  Failures fail(rank_);
  const LegacyCase c = make_case(spec_, options_, rank_, spec_.fp8 ? DType::kFP8E4M3 : DType::kBF16, all_);
  Dispatched d;
  d.layout = buffer.get_dispatch_layout(c.topk, spec_.num_experts);
  check_layout(c, d.layout, fail);
  d.result = first_dispatch(buffer, c, d.layout);
  check_received(c, ref_, d.result, static_cast<std::int64_t>(ref_.rows.size()), fail);
  problems.insert(problems.end(), fail.list().begin(), fail.list().end());
  return d;
}

void LegacyCalls::combine(Buffer& buffer, const Dispatched& dispatched, std::vector<std::string>& problems) {
  Failures fail(rank_);
  const LegacyCase c = make_case(spec_, options_, rank_, spec_.fp8 ? DType::kFP8E4M3 : DType::kBF16, all_);
  check_combine(buffer, c, dispatched.layout, ref_, dispatched.result, static_cast<std::int64_t>(ref_.rows.size()), fail);
  problems.insert(problems.end(), fail.list().begin(), fail.list().end());
}

std::int64_t low_latency_rdma_bytes(const CaseSpec& s) {
  return Buffer::get_low_latency_rdma_size_hint(s.max_tokens, s.hidden, s.ranks, s.num_experts);
}

std::string describe(const CaseSpec& s, const LegacyRunOptions& o) {
  return fmt::format(
      "V1 seed {} ranks {} topology {}x{} E {} k {} H {} fp8 {} P {} align {} weights {} bias {} mask {} skew {} "
      "routing {} tokens [{}] async {} cached {} cached_new_inputs {} worst {} with_topk {} num_sms {} payload {} "
      "deepep_hints {}",
      s.seed, s.ranks, s.scaleout, s.ranks / s.scaleout, s.num_experts, s.k, s.hidden, s.fp8, s.scale_cols, s.alignment,
      s.weights, s.num_bias, s.mask_ratio, s.skew, s.fixed_topk.empty() ? std::to_string(s.routing_style) : std::string("fixed"),
      fmt::join(s.tokens, ","), o.async, o.cached, o.cached_new_inputs, o.num_worst_tokens, o.with_topk, o.num_sms,
      o.payload_dtype ? dtype_name(*o.payload_dtype) : "default", o.deepep_hints);
}

}  // namespace moe_ep::testing
