// Buffer::dispatch (DeepEP V1 normal mode) on the shared engine: the request built from the V1
// arguments (NVFP4 triples packed into byte rows, routing from topk_idx or from is_token_in_rank
// alone), the V1 checks run through the engine's agreement (check_generation_arguments), and the V1 handle
// filled from the engine's routing state once the call completed.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/arith.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "legacy/buffer_core.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "moe_ep/limits.hpp"
#include "routing/plan.hh"

namespace moe_ep {
namespace {

constexpr std::int64_t kMaxInt = std::numeric_limits<std::int32_t>::max();

// The V1 handle's tensors, from the engine's routing state once the dispatch completed.
void fill_legacy_handle(LegacyHandle& lh, const EPHandle& h, int rank, int num_nodes, const TensorView& in_rank_input) {
  const engine::HandleState& s = *h.state;
  const auto& layout = s.layout;
  const int R = layout.geometry().num_ranks, C = lh.num_channels, N = h.num_tokens, k = h.num_topk;
  lh.rank_prefix_matrix = Tensor::empty({R, R}, DType::kInt32);
  for (int r = 0; r < R; ++r) {
    std::int32_t acc = 0;
    for (int src = 0; src < R; ++src) {
      acc += layout.count(src, r);
      lh.rank_prefix_matrix.data_as<std::int32_t>()[src * R + r] = acc;
    }
  }
  // Channels are contiguous token ranges of ceil(N / C) tokens.
  auto channel_of = [C](int token, int tokens) { return token / std::max(1, core::ceil_div(tokens, C)); };
  lh.send_head = Tensor::empty({N, R}, DType::kInt32);
  std::fill(lh.send_head.data_as<std::int32_t>(), lh.send_head.data_as<std::int32_t>() + std::int64_t{N} * R, -1);
  lh.channel_prefix_matrix = Tensor::zeros({R, C}, DType::kInt32);
  const auto* topk = s.topk.data_as<const std::int64_t>();
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int32_t row = s.dst_row[static_cast<size_t>(t) * k + j];
      if (row < 0) continue;
      const int d = layout.geometry().rank_of_expert(topk[t * s.topk.stride(0) + j]);
      lh.send_head.data_as<std::int32_t>()[std::int64_t{t} * R + d] = row - layout.row_base(rank, d);
      ++lh.channel_prefix_matrix.data_as<std::int32_t>()[d * C + channel_of(t, N)];
    }
  for (int d = 0; d < R; ++d)
    for (int c = 1; c < C; ++c)
      lh.channel_prefix_matrix.data_as<std::int32_t>()[d * C + c] += lh.channel_prefix_matrix.data_as<std::int32_t>()[d * C + c - 1];
  const auto rows = static_cast<std::int64_t>(s.rows.size());
  lh.recv_src_idx = Tensor::empty({rows}, DType::kInt32);
  lh.recv_channel_prefix_matrix = Tensor::zeros({R, C}, DType::kInt32);
  std::vector<std::int32_t> per_channel(static_cast<size_t>(R) * C, 0);
  for (std::int64_t i = 0; i < rows; ++i) {
    const int src = s.rows[static_cast<size_t>(i)].source, token = s.row_token[static_cast<size_t>(i)];
    lh.recv_src_idx.data_as<std::int32_t>()[i] = token;
    ++per_channel[static_cast<size_t>(src) * C + channel_of(token, s.source_tokens[static_cast<size_t>(src)])];
  }
  for (int src = 0; src < R; ++src)  // exclusive prefix: where channel c starts in the source's block
    for (int c = 1; c < C; ++c)
      lh.recv_channel_prefix_matrix.data_as<std::int32_t>()[src * C + c] =
          lh.recv_channel_prefix_matrix.data_as<std::int32_t>()[src * C + c - 1] + per_channel[static_cast<size_t>(src) * C + c - 1];
  lh.recv_gbl_rank_prefix_sum = Tensor::empty({R}, DType::kInt32);
  std::int32_t acc = 0;
  for (int src = 0; src < R; ++src) lh.recv_gbl_rank_prefix_sum.data_as<std::int32_t>()[src] = acc += layout.count(src, rank);
  if (num_nodes > 1) {
    const int per_node = R / num_nodes, my_node = rank / per_node;
    lh.recv_rdma_rank_prefix_sum = Tensor::empty({num_nodes}, DType::kInt32);
    acc = 0;
    for (int node = 0; node < num_nodes; ++node)
      lh.recv_rdma_rank_prefix_sum.data_as<std::int32_t>()[node] = acc +=
          layout.node_count(node * per_node + rank % per_node, my_node);
  }
  lh.is_token_in_rank = Tensor::empty({N, R}, DType::kBool);
  if (in_rank_input.defined()) {
    for (int t = 0; t < N; ++t)
      std::memcpy(lh.is_token_in_rank.data_as<std::uint8_t>() + std::int64_t{t} * R,
                  in_rank_input.data_as<const std::uint8_t>() + t * in_rank_input.stride(0), static_cast<size_t>(R));
  } else {
    for (std::int64_t i = 0; i < std::int64_t{N} * R; ++i)
      lh.is_token_in_rank.data_as<std::uint8_t>()[i] = lh.send_head.data_as<std::int32_t>()[i] >= 0;
  }
}

// NVFP4 token triples (LegacyDispatchArgs::x_nvfp4) travel as one byte row per token: packed |
// sf | sf_scale, zero-padded to a multiple of the payload row rule (kRowByteMultiple).
constexpr const char* kNvfp4Operation = "dispatch (NVFP4)";
constexpr const char* kPackedName = "x[0] (packed)";
constexpr const char* kSfName = "x[1] (sf)";
constexpr const char* kSfScaleName = "x[2] (sf_scale)";

struct Nvfp4Layout {
  int hidden = 0;                                     // H = 8 x packed columns
  int packed_cols = 0, sf_cols = 0, scale_cols = 0;   // int32, int32 and float32 columns
  std::int64_t row_bytes = 0;                          // padded
  std::int64_t sf_offset() const { return 4 * std::int64_t{packed_cols}; }
  std::int64_t scale_offset() const { return sf_offset() + 4 * std::int64_t{sf_cols}; }
  std::int64_t used_bytes() const { return scale_offset() + 4 * std::int64_t{scale_cols}; }
};

Nvfp4Layout check_nvfp4(const std::string& ctx, const LegacyDispatchArgs& args, int nodes) {
  const Nvfp4Tokens& x = *args.x_nvfp4;
  if (args.x.defined() || args.x_scales.defined())
    core::fail(ctx, "x_nvfp4 is given together with {}: an NVFP4 dispatch takes the triple (packed, sf, sf_scale) "
               "alone", args.x.defined() ? "x" : "x_scales");
  if (nodes > 1)
    core::fail(ctx, "x as an NVFP4 triple (packed, sf, sf_scale) is intranode only, as in DeepEP's hybrid-ep: all "
               "ranks must be on one node, and this group spans {} nodes", nodes);
  core::expect_tensor(ctx, kPackedName, x.packed, DType::kInt32, {-1, -1});
  core::expect_tensor(ctx, kSfName, x.sf, DType::kInt32, {-1, -1});
  core::expect_tensor(ctx, kSfScaleName, x.sf_scale, DType::kFP32, {-1, -1});
  Nvfp4Layout l;
  const int n = core::int_size(ctx, kPackedName, x.packed, 0);
  l.packed_cols = core::int_size(ctx, kPackedName, x.packed, 1);
  if (l.packed_cols <= 0 || l.packed_cols % 8 != 0 || l.packed_cols > kMaxHidden / 8)
    core::fail(ctx, "{} has {} columns (int32, eight E2M1 codes each: H/8), expected a positive multiple of 8 up to "
               "{} (H a multiple of 64, the elements of one sf int32, and at most {})", kPackedName, l.packed_cols,
               kMaxHidden / 8, kMaxHidden);
  l.hidden = 8 * l.packed_cols;
  for (const auto& [name, t] : {std::pair{kSfName, x.sf}, {kSfScaleName, x.sf_scale}})
    if (t.size(0) != n)
      core::fail(ctx, "{} has {} tokens but {} has {}: the three parts of x must have the same number of tokens",
                 name, t.size(0), kPackedName, n);
  if (x.sf.size(1) != l.packed_cols / 8)
    core::fail(ctx, "{} has {} columns, expected H/64 = {} (one int32 of four E4M3 scales per 64 elements) for the "
               "H = {} that {} implies", kSfName, x.sf.size(1), l.packed_cols / 8, l.hidden, kPackedName);
  l.sf_cols = l.packed_cols / 8;
  l.scale_cols = core::int_size(ctx, kSfScaleName, x.sf_scale, 1);
  if (l.scale_cols < 1) core::fail(ctx, "{} has {} columns, expected at least 1", kSfScaleName, l.scale_cols);
  core::expect_rows_contiguous(ctx, kPackedName, x.packed);
  core::expect_rows_contiguous(ctx, kSfName, x.sf);
  core::expect_rows_contiguous(ctx, kSfScaleName, x.sf_scale);
  l.row_bytes = core::round_up<std::int64_t>(l.used_bytes(), kRowByteMultiple);
  if (l.row_bytes > kMaxHidden)
    core::fail(ctx, "an NVFP4 token (packed, sf and {} sf_scale columns) is {} bytes, more than the {} bytes a "
               "dispatched row may have", l.scale_cols, l.row_bytes, kMaxHidden);
  return l;
}

// One byte row per token: the three parts side by side, then zeros.
Tensor pack_nvfp4(const Nvfp4Tokens& x, const Nvfp4Layout& l) {
  const std::int64_t n = x.packed.size(0);
  Tensor rows = Tensor::empty({n, l.row_bytes}, DType::kUInt8);
  for (std::int64_t t = 0; t < n; ++t) {
    auto* row = rows.data_as<std::uint8_t>() + t * l.row_bytes;
    std::memcpy(row, x.packed.data_as<const std::int32_t>() + t * x.packed.stride(0), static_cast<size_t>(l.sf_offset()));
    std::memcpy(row + l.sf_offset(), x.sf.data_as<const std::int32_t>() + t * x.sf.stride(0),
                static_cast<size_t>(l.scale_offset() - l.sf_offset()));
    std::memcpy(row + l.scale_offset(), x.sf_scale.data_as<const float>() + t * x.sf_scale.stride(0),
                static_cast<size_t>(l.used_bytes() - l.scale_offset()));
    std::memset(row + l.used_bytes(), 0, static_cast<size_t>(l.row_bytes - l.used_bytes()));
  }
  return rows;
}

// The received byte rows [0, rows) back into the three parts.
void unpack_nvfp4(const Tensor& recv, std::int64_t rows, const Nvfp4Layout& l, Nvfp4Rows& out) {
  for (std::int64_t i = 0; i < rows; ++i) {
    const auto* row = recv.data_as<const std::uint8_t>() + i * recv.stride(0);
    std::memcpy(out.packed.data_as<std::int32_t>() + i * l.packed_cols, row, static_cast<size_t>(l.sf_offset()));
    std::memcpy(out.sf.data_as<std::int32_t>() + i * l.sf_cols, row + l.sf_offset(),
                static_cast<size_t>(l.scale_offset() - l.sf_offset()));
    std::memcpy(out.sf_scale.data_as<float>() + i * l.scale_cols, row + l.scale_offset(),
                static_cast<size_t>(l.used_bytes() - l.scale_offset()));
  }
}

template <class T>
std::int64_t first_difference(const T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return i;
  return -1;
}

// The NVFP4 triple of a dispatch, checked and packed into byte rows before the call; a rejection
// is raised through the engine's agreement (check_generation_arguments), so that peers learn of it.
struct Nvfp4Dispatch {
  Nvfp4Layout layout;
  Tensor rows;  // the packed rows, kept alive by the request until the call completes
  std::shared_ptr<Nvfp4Rows> out = std::make_shared<Nvfp4Rows>();
  std::exception_ptr error;
};

// Replaces the triple of `args` by the packed rows and has the request unpack what it receives.
void prepare_nvfp4(engine::Engine& e, const LegacyDispatchArgs& given, int nodes, LegacyDispatchArgs& args,
                   engine::DispatchRequest& r, Nvfp4Dispatch& nvfp4) {
  r.operation = kNvfp4Operation;
  args.x_nvfp4.reset();
  if (r.rejection.empty()) {
    const std::string context = e.facts.context(kNvfp4Operation);
    nvfp4.error = core::attempt(context, [&] {
      nvfp4.layout = check_nvfp4(context, given, nodes);
      nvfp4.rows = pack_nvfp4(*given.x_nvfp4, nvfp4.layout);
      args.x = nvfp4.rows;
      r.generation.handle_hidden = nvfp4.layout.hidden;
    });
  }
  r.allocate_unpacked_outputs = [layout = nvfp4.layout, out = nvfp4.out](const DispatchResult& res) {
    const std::int64_t rows = res.recv_x.size(0);
    out->packed = Tensor::empty({rows, layout.packed_cols}, DType::kInt32);
    out->sf = Tensor::empty({rows, layout.sf_cols}, DType::kInt32);
    out->sf_scale = Tensor::empty({rows, layout.scale_cols}, DType::kFP32);
  };
  r.unpack_received_rows = [layout = nvfp4.layout, out = nvfp4.out, rows = nvfp4.rows](const DispatchResult& res) {
    unpack_nvfp4(res.recv_x, static_cast<std::int64_t>(res.handle->state->rows.size()), layout, *out);
  };
}

// The request's options from the V1 arguments and config (everything but the routing).
void set_options(engine::DispatchRequest& r, const LegacyDispatchArgs& args, const Config& config,
                 const engine::Engine& e, bool cached) {
  r.x = args.x;
  r.x_scales = args.x_scales;
  r.topk_weights = args.topk_weights;
  r.expert_alignment = args.expert_alignment;
  r.workers = legacy::normal_mode_workers(e, config);
  r.previous_event = args.previous_event;
  r.async = args.async_finish;
  r.generation.zero_nonlocal_weights = true;
  r.max_tokens = 0;  // V1 has no token cap: the call's largest token count
  r.generation.worst_rows = args.num_worst_tokens;
  r.cpu_sync = !cached && args.num_worst_tokens == 0;
}

// Whether the routing can be read from is_token_in_rank and num_tokens_per_expert before the V1
// checks run: the types and sizes its reads and its allocation rely on (a view may claim more
// rows than x has). What the routing must be to be used (a positive multiple of R experts, at most
// kMaxTopk ranks) is left to the V1 checks, which the engine runs first: a call they reject never
// uses what was built here.
bool rank_mask_readable(const LegacyDispatchArgs& args, int R) {
  const TensorView& in_rank = args.is_token_in_rank;
  const TensorView& per_expert = args.num_tokens_per_expert;
  return in_rank.defined() && in_rank.dtype() == DType::kBool && in_rank.ndim() == 2 && in_rank.size(1) == R &&
         args.x.defined() && in_rank.size(0) == args.x.size(0) && args.x.size(0) <= kMaxInt &&
         per_expert.defined() && per_expert.dtype() == DType::kInt32 && per_expert.ndim() == 1 &&
         per_expert.size(0) <= kMaxInt;
}

// Routing: the cached handle's, topk_idx, or is_token_in_rank alone. Returns the synthetic
// topk_idx of the last (lane d names rank d's first expert), which must outlive the call.
Tensor set_routing(engine::DispatchRequest& r, const LegacyDispatchArgs& args, int R, bool cached, bool routed_by_ids) {
  if (cached) {
    r.handle = args.handle->routing;
    if (r.handle) r.expert_alignment = r.handle->expert_alignment;  // V1 takes it from the handle
    return {};
  }
  if (routed_by_ids) {
    r.topk_idx = args.topk_idx;
    // The V1 checks refuse more than INT32_MAX experts before this is used.
    r.num_experts = args.num_tokens_per_expert.defined()
                        ? static_cast<int>(std::min<std::int64_t>(args.num_tokens_per_expert.size(0), kMaxInt))
                        : 0;
    return {};
  }
  if (!rank_mask_readable(args, R)) return {};
  const std::int64_t n = args.is_token_in_rank.size(0);
  const int E = static_cast<int>(args.num_tokens_per_expert.size(0)), El = E / R;
  Tensor synthetic = Tensor::empty({n, R}, DType::kInt64);
  for (std::int64_t t = 0; t < n; ++t)
    for (int d = 0; d < R; ++d)
      synthetic.data_as<std::int64_t>()[t * R + d] =
          args.is_token_in_rank.data_as<const std::uint8_t>()[t * args.is_token_in_rank.stride(0) + d] ? std::int64_t{d} * El : -1;
  r.topk_idx = synthetic;
  r.num_experts = E;
  r.generation.expert_counts.assign(args.num_tokens_per_expert.data_as<const std::int32_t>(),
                         args.num_tokens_per_expert.data_as<const std::int32_t>() + E);
  return synthetic;
}

// The V1 checks (DispatchRequest::check_generation_arguments): the config, the layout tensors and, with
// topk_idx, that the layout is the one get_dispatch_layout computes from it.
struct V1Checks {
  LegacyDispatchArgs args;
  Config config;
  bool cached = false, routed_by_ids = false;
  int R = 1, nodes = 1;
  std::exception_ptr nvfp4_error;

  void operator()(const std::string& ctx) const {
    if (nvfp4_error) std::rethrow_exception(nvfp4_error);
    config.validate(ctx);
    legacy::check_comm_stream_flags(ctx, args.allocate_on_comm_stream, args.previous_event.has_value(), args.async_finish);
    if (args.num_worst_tokens < 0) core::fail(ctx, "num_worst_tokens = {} is negative", args.num_worst_tokens);
    if (cached) return check_cached(ctx);
    const auto [n, E] = check_layout_tensors(ctx);
    if (!routed_by_ids) return check_rank_mask(ctx, n);
    check_layout_of_topk(ctx, n, E);
  }

  // DeepEP's rule: the top-k arguments must be absent; layout tensors given with a handle are
  // ignored (the handle's layout is used).
  void check_cached(const std::string& ctx) const {
    for (const auto& [name, t] : {std::pair{"topk_idx", args.topk_idx}, {"topk_weights", args.topk_weights}})
      if (t.defined()) core::fail(ctx, "{} must not be given with a cached handle", name);
  }

  // x, is_token_in_rank and the counts; returns the token and expert counts.
  std::pair<int, int> check_layout_tensors(const std::string& ctx) const {
    if (!args.x.defined()) core::fail(ctx, "x is missing");
    const int n = core::int_size(ctx, "x", args.x, 0);
    core::expect_tensor(ctx, "is_token_in_rank", args.is_token_in_rank, DType::kBool, {n, R});
    core::expect_contiguous(ctx, "is_token_in_rank", args.is_token_in_rank);
    core::expect_tensor(ctx, "num_tokens_per_rank", args.num_tokens_per_rank, DType::kInt32, {R});
    core::expect_tensor(ctx, "num_tokens_per_expert", args.num_tokens_per_expert, DType::kInt32, {-1});
    const int E = core::int_size(ctx, "num_tokens_per_expert", args.num_tokens_per_expert, 0);
    if (E <= 0 || E % R != 0) core::fail(ctx, "num_tokens_per_expert has {} entries, expected a positive multiple of {}", E, R);
    if (nodes > 1) {
      core::expect_tensor(ctx, "num_tokens_per_rdma_rank", args.num_tokens_per_rdma_rank, DType::kInt32, {nodes});
    } else if (args.num_tokens_per_rdma_rank.defined()) {
      core::fail(ctx, "num_tokens_per_rdma_rank is given but all {} ranks are on one node", R);
    }
    if (args.num_worst_tokens > 0 && !routed_by_ids) core::fail(ctx, "num_worst_tokens needs topk_idx");
    if (args.topk_weights.defined() && !routed_by_ids) core::fail(ctx, "topk_weights is given without topk_idx");
    return {n, E};
  }

  // Without topk_idx: num_tokens_per_rank counts is_token_in_rank.
  void check_rank_mask(const std::string& ctx, int n) const {
    const auto* in_rank = args.is_token_in_rank.data_as<const std::uint8_t>();
    if (R > kMaxTopk)
      core::fail(ctx, "dispatch without topk_idx supports at most {} ranks (the group has {})", kMaxTopk, R);
    for (int d = 0; d < R; ++d) {
      std::int32_t count = 0;
      for (std::int64_t t = 0; t < n; ++t) count += in_rank[t * R + d] != 0;
      if (count != args.num_tokens_per_rank.data_as<const std::int32_t>()[d])
        core::fail(ctx, "num_tokens_per_rank[{}] = {}, but is_token_in_rank sends {} tokens there", d,
                   args.num_tokens_per_rank.data_as<const std::int32_t>()[d], count);
    }
  }

  // With topk_idx, the layout must be the one get_dispatch_layout computes from it.
  void check_layout_of_topk(const std::string& ctx, int n, int E) const {
    core::expect_tensor(ctx, "topk_idx", args.topk_idx, DType::kInt64, {n, -1});
    core::expect_rows_contiguous(ctx, "topk_idx", args.topk_idx);
    const int k = core::int_size(ctx, "topk_idx", args.topk_idx, 1);
    if (k < 1 || k > kMaxTopk) core::fail(ctx, "topk_idx has {} columns (k), expected 1 to {}", k, kMaxTopk);
    const routing::TopkRows rows{args.topk_idx.data_as<const std::int64_t>(), args.topk_idx.stride(0), n, k};
    routing::validate_topk(ctx, rows, E);
    const routing::Geometry geo{R, E, nodes};
    routing::LocalCounts counts;
    routing::count_local(rows, geo, counts);
    if (auto i = first_difference(counts.per_rank.data(), args.num_tokens_per_rank.data_as<const std::int32_t>(), R); i >= 0)
      core::fail(ctx, "num_tokens_per_rank[{}] = {}, but topk_idx sends {} tokens there", i,
                 args.num_tokens_per_rank.data_as<const std::int32_t>()[i], counts.per_rank[static_cast<size_t>(i)]);
    if (auto i = first_difference(counts.per_expert.data(), args.num_tokens_per_expert.data_as<const std::int32_t>(), E); i >= 0)
      core::fail(ctx, "num_tokens_per_expert[{}] = {}, but topk_idx selects expert {} {} times", i,
                 args.num_tokens_per_expert.data_as<const std::int32_t>()[i], i, counts.per_expert[static_cast<size_t>(i)]);
    if (nodes > 1)
      if (auto i = first_difference(counts.per_node.data(), args.num_tokens_per_rdma_rank.data_as<const std::int32_t>(), nodes); i >= 0)
        core::fail(ctx, "num_tokens_per_rdma_rank[{}] = {}, but topk_idx sends {} tokens there", i,
                   args.num_tokens_per_rdma_rank.data_as<const std::int32_t>()[i], counts.per_node[static_cast<size_t>(i)]);
    const auto* in_rank = args.is_token_in_rank.data_as<const std::uint8_t>();
    for (std::int64_t t = 0; t < n; ++t)
      for (int d = 0; d < R; ++d) {
        bool expected = false;
        for (int j = 0; j < k; ++j) expected |= rows.row(static_cast<int>(t))[j] >= 0 && geo.rank_of_expert(rows.row(static_cast<int>(t))[j]) == d;
        if ((in_rank[t * R + d] != 0) != expected)
          core::fail(ctx, "is_token_in_rank[{}, {}] = {}, but topk_idx {} an expert of rank {} for token {}", t, d,
                     in_rank[t * R + d] != 0, expected ? "names" : "names no", d, t);
      }
  }
};

// A new V1 handle, filled from the engine's handle when the call completes (none when cached).
std::shared_ptr<LegacyHandle> new_legacy_handle(engine::DispatchRequest& r, const LegacyDispatchArgs& args,
                                                const Config& config, int rank, int nodes) {
  auto legacy_handle = std::make_shared<LegacyHandle>();
  legacy_handle->num_channels = std::max(1, config.num_sms / 2);
  const TensorView in_rank = args.is_token_in_rank;
  r.fill_generation_handle = [legacy_handle, rank, nodes, in_rank](const EPHandle& h) {
    fill_legacy_handle(*legacy_handle, h, rank, nodes, in_rank);
  };
  return legacy_handle;
}

// What V1 returns: DeepEP returns only x (and scales) from a cached dispatch.
LegacyDispatchResult v1_result(const DispatchResult& done, const Nvfp4Dispatch* nvfp4, bool routed_by_ids,
                               const std::shared_ptr<LegacyHandle>& legacy_handle) {
  LegacyDispatchResult out;
  if (nvfp4) {
    out.recv_x_nvfp4 = *nvfp4->out;  // allocated with the outputs; filled when the call completes
  } else {
    out.recv_x = done.recv_x;
  }
  out.recv_x_scales = done.recv_x_scales;
  out.event = done.event;
  if (!legacy_handle) return out;
  if (routed_by_ids) {
    out.recv_topk_idx = done.recv_topk_idx;
    out.recv_topk_weights = done.recv_topk_weights;
  }
  out.num_recv_tokens_per_expert_list = done.handle->num_recv_tokens_per_expert_list;
  legacy_handle->routing = done.handle;
  out.handle = legacy_handle;
  return out;
}

}  // namespace

LegacyDispatchResult Buffer::dispatch(const LegacyDispatchArgs& given) {
  std::lock_guard lock(*core_->calls);
  auto& e = core_->engine;
  e.check_usable("dispatch");
  const Config config = given.config.value_or(get_dispatch_config(e.facts.num_ranks));
  const bool cached = given.handle != nullptr;
  const int R = e.facts.num_ranks, nodes = e.facts.physical.num_scaleout;
  const bool routed_by_ids = given.topk_idx.defined();
  engine::DispatchRequest r;
  r.rejection = given.rejection;
  LegacyDispatchArgs args = given;
  Nvfp4Dispatch nvfp4;
  const bool is_nvfp4 = given.x_nvfp4.has_value();
  if (is_nvfp4) prepare_nvfp4(e, given, nodes, args, r, nvfp4);
  set_options(r, args, config, e, cached);
  const Tensor synthetic = set_routing(r, args, R, cached, routed_by_ids);
  r.check_generation_arguments = V1Checks{args, config, cached, routed_by_ids, R, nodes, nvfp4.error};
  const std::shared_ptr<LegacyHandle> legacy_handle = cached ? nullptr : new_legacy_handle(r, args, config, e.facts.rank, nodes);
  if (nodes > 1) core_->normal_call_used_pool();
  const DispatchResult done = e.execute(engine::make_dispatch(e, std::move(r), e.next_sequence()), args.async_finish);
  return v1_result(done, is_nvfp4 ? &nvfp4 : nullptr, routed_by_ids, legacy_handle);
}

}  // namespace moe_ep
