// Buffer (DeepEP V1): configuration, layout, and normal mode on the shared engine. Low-latency
// mode is in low_latency.cc.
#include "moe_ep/legacy_buffer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/checks.hh"
#include "core/executor.hh"
#include "core/fabric.hh"
#include "core/log.hh"
#include "core/timeout.hh"
#include "legacy/buffer_core.hh"
#include "moe_ep/error.hpp"
#include "routing/plan.hh"

namespace moe_ep {
namespace {

std::atomic<int> g_num_sms{20};
constexpr std::int64_t kMaxInt = std::numeric_limits<std::int32_t>::max();

void check_num_sms_value(const std::string& context, int num_sms) {
  if (num_sms < 2 || num_sms > core::kMaxWorkers || num_sms % 2 != 0)
    core::fail(context, "num_sms = {} must be an even number in [2, {}]", num_sms, core::kMaxWorkers);
}

void check_pool(const std::string& context, const char* name, std::int64_t bytes) {
  if (bytes < 0 || bytes % 128 != 0) core::fail(context, "{} = {} must be a non-negative multiple of 128", name, bytes);
}

std::exception_ptr check_config(const std::string& context, const BufferConfig& c) {
  try {
    check_pool(context, "num_nvl_bytes", c.num_nvl_bytes);
    check_pool(context, "num_rdma_bytes", c.num_rdma_bytes);
    if (c.num_qps_per_rank < 1) core::fail(context, "num_qps_per_rank = {} must be at least 1", c.num_qps_per_rank);
    core::checked_timeout(context, "num_cpu_timeout_secs", c.num_cpu_timeout_secs);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

engine::EngineConfig engine_config(const BufferConfig& c) {
  engine::EngineConfig e;
  e.name = "Buffer";
  e.pool_bytes = std::max<std::int64_t>(c.num_rdma_bytes, 0);
  e.pool_alignment = 128;
  e.allow_hybrid_mode = true;  // across nodes V1 always sends each token once per node
  e.allow_multiple_reduction = true;
  e.num_allocated_qps = core::cap_inflight(std::max(c.num_qps_per_rank, 1));
  // A rejected configuration still takes part in the construction agreement, with a sane wait.
  e.timeout_secs = std::isfinite(c.num_cpu_timeout_secs) && c.num_cpu_timeout_secs > 0 ? c.num_cpu_timeout_secs : 1;
  e.explicitly_destroy = c.explicitly_destroy;
  return e;
}

// Worker threads of a normal-mode call: num_sms / 2 channels, capped by the cores per rank.
std::function<int(int, int)> config_workers(const engine::Engine& e, const Config& config) {
  const int channels = std::max(1, config.num_sms / 2);
  const int cap = e.cores_per_rank();
  return [channels, cap](int, int) { return std::min(channels, cap); };
}

struct DefaultConfig {
  int ranks;
  int dispatch[4];  // nvl send, nvl recv, rdma send, rdma recv
  int combine[4];
};
constexpr DefaultConfig kDefaults[] = {
    {2, {24, 256, 6, 128}, {10, 256, 6, 128}},    {4, {6, 256, 6, 128}, {9, 256, 6, 128}},
    {8, {6, 256, 6, 128}, {4, 256, 6, 128}},      {16, {36, 288, 20, 128}, {4, 288, 12, 128}},
    {24, {32, 288, 8, 128}, {1, 288, 8, 128}},    {32, {32, 288, 8, 128}, {1, 288, 8, 128}},
    {48, {32, 288, 8, 128}, {1, 288, 8, 128}},    {64, {32, 288, 8, 128}, {1, 288, 8, 128}},
    {96, {20, 480, 12, 128}, {1, 480, 8, 128}},   {128, {20, 560, 12, 128}, {1, 560, 8, 128}},
    {144, {32, 720, 12, 128}, {2, 720, 8, 128}},  {160, {28, 720, 12, 128}, {2, 720, 8, 128}},
};

const DefaultConfig& default_for(int num_ranks) {
  for (const auto& d : kDefaults)
    if (d.ranks >= num_ranks) return d;
  return kDefaults[std::size(kDefaults) - 1];
}

}  // namespace

// ---- Config ------------------------------------------------------------------------------------

Config Config::make(int num_sms, int nvl_send, int nvl_recv, int rdma_send, int rdma_recv) {
  Config c{num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv};
  if (rdma_send > 0) c.num_max_rdma_chunked_recv_tokens = (rdma_recv + rdma_send - 1) / rdma_send * rdma_send;
  c.validate("Config");
  return c;
}

void Config::validate(const std::string& context) const {
  check_num_sms_value(context, num_sms);
  if (num_max_nvl_chunked_send_tokens <= 0 || num_max_nvl_chunked_recv_tokens <= 0)
    core::fail(context, "NVL chunk sizes ({}, {}) must be positive", num_max_nvl_chunked_send_tokens,
               num_max_nvl_chunked_recv_tokens);
  if (num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens)
    core::fail(context, "num_max_nvl_chunked_send_tokens = {} must be less than num_max_nvl_chunked_recv_tokens = {}",
               num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens);
  if (num_max_rdma_chunked_send_tokens <= 0 || num_max_rdma_chunked_recv_tokens <= 0)
    core::fail(context, "RDMA chunk sizes ({}, {}) must be positive", num_max_rdma_chunked_send_tokens,
               num_max_rdma_chunked_recv_tokens);
  if (num_max_rdma_chunked_send_tokens > num_max_rdma_chunked_recv_tokens / 2)
    core::fail(context, "num_max_rdma_chunked_send_tokens = {} must be at most half of num_max_rdma_chunked_recv_tokens "
               "= {}", num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens);
}

std::int64_t Config::get_nvl_buffer_size_hint(std::int64_t hidden_bytes, int num_ranks) const {
  const std::int64_t C = num_sms / 2, Nn = std::min(num_ranks, 8), Nr = std::max(num_ranks / 8, 1);
  const std::int64_t T = num_max_nvl_chunked_recv_tokens;
  const std::int64_t bytes = C * Nn * (2 * Nr + 3) * 4 + C * Nn * T * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4);
  return (bytes + 127) / 128 * 128;
}

std::int64_t Config::get_rdma_buffer_size_hint(std::int64_t hidden_bytes, int num_ranks) const {
  if (num_ranks <= 8) return 0;
  const std::int64_t C = num_sms / 2, Nr = num_ranks / 8, T = num_max_rdma_chunked_recv_tokens;
  const std::int64_t bytes =
      C * Nr * (8 * 2 + 2) * 2 * 4 + 2 * C * Nr * T * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16);
  return (bytes + 127) / 128 * 128;
}

void ReceiveHook::operator()() const {
  if (!receive_) throw StateError("this receive hook is empty (the call was made without return_recv_hook)");
  (*receive_)();
}

// ---- BufferCore --------------------------------------------------------------------------------

namespace legacy {

BufferCore::BufferCore(Group& group, const BufferConfig& cfg)
    : config(cfg),
      engine(group, engine_config(cfg), check_config(fmt::format("[rank {}] Buffer", group.rank()), cfg),
             [&](comm::Agreement& a) {
               a.field("num_nvl_bytes", cfg.num_nvl_bytes)
                   .field("num_rdma_bytes", cfg.num_rdma_bytes)
                   .field("low_latency_mode", cfg.low_latency_mode)
                   .field("num_qps_per_rank", cfg.num_qps_per_rank);
             }) {
  core::info(core::Subsys::kInit,
             "Buffer #{}: num_nvl_bytes {}, num_rdma_bytes {} (the symmetric pool), low_latency_mode {}, "
             "num_qps_per_rank {} ({} used)",
             engine.id, cfg.num_nvl_bytes, cfg.num_rdma_bytes, cfg.low_latency_mode, cfg.num_qps_per_rank,
             engine.config.num_allocated_qps);
}

}  // namespace legacy

// ---- Buffer ------------------------------------------------------------------------------------

Buffer::Buffer(Group& group, const BufferConfig& config) : core_(std::make_unique<legacy::BufferCore>(group, config)) {}
Buffer::~Buffer() = default;

void Buffer::set_num_sms(int num_sms) {
  check_num_sms_value("Buffer::set_num_sms", num_sms);
  g_num_sms = num_sms;
}
int Buffer::num_sms() { return g_num_sms; }

Config Buffer::get_dispatch_config(int num_ranks) {
  if (num_ranks < 1) throw InvalidArgument(fmt::format("get_dispatch_config: num_ranks = {} must be positive", num_ranks));
  const auto& d = default_for(num_ranks).dispatch;
  return Config::make(g_num_sms, d[0], d[1], d[2], d[3]);
}

Config Buffer::get_combine_config(int num_ranks) {
  if (num_ranks < 1) throw InvalidArgument(fmt::format("get_combine_config: num_ranks = {} must be positive", num_ranks));
  const auto& d = default_for(num_ranks).combine;
  return Config::make(g_num_sms, d[0], d[1], d[2], d[3]);
}

std::int64_t Buffer::get_low_latency_rdma_size_hint(int N, int H, int R, int E) {
  if (N <= 0 || H <= 0 || R <= 0 || E <= 0 || H % 128 != 0)
    throw InvalidArgument(fmt::format("get_low_latency_rdma_size_hint: needs positive N ({}), R ({}), E ({}) and hidden "
                                      "({}) a multiple of 128", N, R, E, H));
  const std::int64_t S = H / 128;
  const std::int64_t dispatch_msg = 16 + std::max<std::int64_t>(2 * H, H + 4 * S);
  const std::int64_t combine_msg = 4 * S + 2 * H;
  const std::int64_t send = std::max<std::int64_t>(N * dispatch_msg, std::int64_t{E} * N * combine_msg);
  const std::int64_t recv = std::max<std::int64_t>(std::int64_t{E} * N * dispatch_msg, std::int64_t{E} * N * combine_msg);
  const std::int64_t signal = (4 * std::int64_t{E} + 127) / 128 * 128;
  const std::int64_t total = 2 * signal + 2 * send + 2 * recv;
  const std::int64_t deepep = (total + 128) / 128 * 128;  // DeepEP adds 128 even to an exact multiple
  // Ours fits in DeepEP's size except for very few experts; never hand out less than we need.
  return std::max(deepep, (legacy::SlotLayout::pool_bytes(N, H, R, E) + 127) / 128 * 128);
}

DispatchLayout Buffer::get_dispatch_layout(const TensorView& topk_idx, int num_experts,
                                           std::optional<Event> previous_event, bool async_finish,
                                           bool allocate_on_comm_stream) {
  auto& e = core_->engine;
  e.check_usable("get_dispatch_layout");
  const std::string ctx = e.context("get_dispatch_layout");
  core::expect_tensor(ctx, "topk_idx", topk_idx, DType::kInt64, {-1, -1});
  core::expect_contiguous(ctx, "topk_idx", topk_idx);
  const int n = core::int_size(ctx, "topk_idx", topk_idx, 0), k = core::int_size(ctx, "topk_idx", topk_idx, 1);
  if (k < 1 || k > engine::kMaxTopk) core::fail(ctx, "topk_idx has {} columns (k), expected 1 to {}", k, engine::kMaxTopk);
  if (num_experts <= 0 || num_experts % e.num_ranks != 0)
    core::fail(ctx, "num_experts = {} must be a positive multiple of the {} ranks", num_experts, e.num_ranks);
  const routing::TopkRows rows{topk_idx.data_as<const std::int64_t>(), topk_idx.stride(0), n, k};
  routing::validate_topk(ctx, rows, num_experts);
  e.wait_for_event(previous_event, ctx, "previous_event");
  const int R = e.num_ranks, nodes = e.physical.num_scaleout;
  const routing::Geometry geo{R, num_experts, nodes};
  routing::LocalCounts counts;
  routing::count_local(rows, geo, counts);
  DispatchLayout out;
  out.num_tokens_per_rank = Tensor::empty({R}, DType::kInt32);
  std::copy(counts.per_rank.begin(), counts.per_rank.end(), out.num_tokens_per_rank.data_as<std::int32_t>());
  out.num_tokens_per_expert = Tensor::empty({num_experts}, DType::kInt32);
  std::copy(counts.per_expert.begin(), counts.per_expert.end(), out.num_tokens_per_expert.data_as<std::int32_t>());
  if (nodes > 1) {
    out.num_tokens_per_rdma_rank = Tensor::empty({nodes}, DType::kInt32);
    std::copy(counts.per_node.begin(), counts.per_node.end(), out.num_tokens_per_rdma_rank.data_as<std::int32_t>());
  }
  out.is_token_in_rank = Tensor::zeros({n, R}, DType::kBool);
  auto* in_rank = out.is_token_in_rank.data_as<std::uint8_t>();
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int64_t id = rows.row(t)[j];
      if (id >= 0) in_rank[static_cast<std::int64_t>(t) * R + geo.rank_of_expert(id)] = 1;
    }
  (void)async_finish;
  (void)allocate_on_comm_stream;
  return out;
}

namespace {

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
  auto channel_of = [C](int token, int tokens) { return token / std::max(1, (tokens + C - 1) / C); };
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
// sf | sf_scale, zero-padded to a multiple of the payload row rule (engine::kRowByteMultiple).
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
  if (l.packed_cols <= 0 || l.packed_cols % 8 != 0 || l.packed_cols > engine::kMaxHidden / 8)
    core::fail(ctx, "{} has {} columns (int32, eight E2M1 codes each: H/8), expected a positive multiple of 8 up to "
               "{} (H a multiple of 64, the elements of one sf int32, and at most {})", kPackedName, l.packed_cols,
               engine::kMaxHidden / 8, engine::kMaxHidden);
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
  l.row_bytes = engine::align_to(l.used_bytes(), engine::kRowByteMultiple);
  if (l.row_bytes > engine::kMaxHidden)
    core::fail(ctx, "an NVFP4 token (packed, sf and {} sf_scale columns) is {} bytes, more than the {} bytes a "
               "dispatched row may have", l.scale_cols, l.row_bytes, engine::kMaxHidden);
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

}  // namespace

LegacyDispatchResult Buffer::dispatch(const LegacyDispatchArgs& given) {
  auto& e = core_->engine;
  e.check_usable("dispatch");
  const Config config = given.config.value_or(get_dispatch_config(e.num_ranks));
  const bool cached = given.handle != nullptr;
  const int R = e.num_ranks, nodes = e.physical.num_scaleout;
  const bool routed_by_ids = given.topk_idx.defined();
  engine::DispatchRequest r;
  r.rejection = given.rejection;
  // NVFP4: the triple is checked and packed into byte rows here; a rejection is raised through the
  // engine's agreement (validate_more), so that peers learn of it.
  LegacyDispatchArgs args = given;
  std::exception_ptr nvfp4_error;
  Nvfp4Layout nvfp4;
  Tensor nvfp4_rows;  // the packed rows, kept alive by the request until the call completes
  auto nvfp4_out = std::make_shared<Nvfp4Rows>();
  const bool is_nvfp4 = given.x_nvfp4.has_value();
  if (is_nvfp4) {
    r.operation = kNvfp4Operation;
    args.x_nvfp4.reset();
    if (r.rejection.empty()) {
      try {
        nvfp4 = check_nvfp4(e.context(kNvfp4Operation), given, nodes);
        nvfp4_rows = pack_nvfp4(*given.x_nvfp4, nvfp4);
        args.x = nvfp4_rows;
        r.handle_hidden = nvfp4.hidden;
      } catch (...) {
        nvfp4_error = std::current_exception();
      }
    }
    r.on_outputs_allocated = [nvfp4, nvfp4_out](const DispatchResult& res) {
      const std::int64_t rows = res.recv_x.size(0);
      nvfp4_out->packed = Tensor::empty({rows, nvfp4.packed_cols}, DType::kInt32);
      nvfp4_out->sf = Tensor::empty({rows, nvfp4.sf_cols}, DType::kInt32);
      nvfp4_out->sf_scale = Tensor::empty({rows, nvfp4.scale_cols}, DType::kFP32);
    };
    r.on_rows_received = [nvfp4, nvfp4_out, nvfp4_rows](const DispatchResult& res) {
      unpack_nvfp4(res.recv_x, static_cast<std::int64_t>(res.handle->state->rows.size()), nvfp4, *nvfp4_out);
    };
  }
  r.x = args.x;
  r.x_scales = args.x_scales;
  r.topk_weights = args.topk_weights;
  r.expert_alignment = args.expert_alignment;
  r.workers = config_workers(e, config);
  r.previous_event = args.previous_event;
  r.async = args.async_finish;
  r.zero_nonlocal_weights = true;
  r.max_tokens = 0;  // V1 has no token cap: the call's largest token count
  r.worst_rows = args.num_worst_tokens;
  r.cpu_sync = !cached && args.num_worst_tokens == 0;
  Tensor synthetic;  // routing from is_token_in_rank alone: lane d names rank d's first expert
  if (cached) {
    r.handle = args.handle->routing;
    if (r.handle) r.expert_alignment = r.handle->expert_alignment;  // V1 takes it from the handle
  } else if (routed_by_ids) {
    r.topk_idx = args.topk_idx;
    // validate_more refuses more than INT32_MAX experts before this is used.
    r.num_experts = args.num_tokens_per_expert.defined()
                        ? static_cast<int>(std::min<std::int64_t>(args.num_tokens_per_expert.size(0), kMaxInt))
                        : 0;
  } else if (args.is_token_in_rank.defined() && args.is_token_in_rank.dtype() == DType::kBool &&
             args.is_token_in_rank.ndim() == 2 && args.is_token_in_rank.size(1) == R && R <= engine::kMaxTopk &&
             args.x.defined() && args.is_token_in_rank.size(0) == args.x.size(0) && args.num_tokens_per_expert.defined() &&
             args.num_tokens_per_expert.ndim() == 1 && args.num_tokens_per_expert.size(0) > 0 &&
             args.num_tokens_per_expert.size(0) <= kMaxInt && args.x.size(0) <= kMaxInt &&
             args.num_tokens_per_expert.size(0) % R == 0 && args.num_tokens_per_expert.dtype() == DType::kInt32) {
    const std::int64_t n = args.is_token_in_rank.size(0);
    const int E = static_cast<int>(args.num_tokens_per_expert.size(0)), El = E / R;
    synthetic = Tensor::empty({n, R}, DType::kInt64);
    for (std::int64_t t = 0; t < n; ++t)
      for (int d = 0; d < R; ++d)
        synthetic.data_as<std::int64_t>()[t * R + d] =
            args.is_token_in_rank.data_as<const std::uint8_t>()[t * args.is_token_in_rank.stride(0) + d] ? std::int64_t{d} * El : -1;
    r.topk_idx = synthetic;
    r.num_experts = E;
    r.expert_counts.assign(args.num_tokens_per_expert.data_as<const std::int32_t>(),
                           args.num_tokens_per_expert.data_as<const std::int32_t>() + E);
  }
  r.validate_more = [args, config, cached, routed_by_ids, R, nodes, nvfp4_error](const std::string& ctx) {
    if (nvfp4_error) std::rethrow_exception(nvfp4_error);
    config.validate(ctx);
    if (args.num_worst_tokens < 0) core::fail(ctx, "num_worst_tokens = {} is negative", args.num_worst_tokens);
    if (cached) {
      for (const auto& [name, t] : {std::pair{"num_tokens_per_rank", args.num_tokens_per_rank},
                                    {"num_tokens_per_rdma_rank", args.num_tokens_per_rdma_rank},
                                    {"is_token_in_rank", args.is_token_in_rank},
                                    {"num_tokens_per_expert", args.num_tokens_per_expert},
                                    {"topk_idx", args.topk_idx}, {"topk_weights", args.topk_weights}})
        if (t.defined()) core::fail(ctx, "{} must not be given with a cached handle", name);
      return;
    }
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
    const auto* in_rank = args.is_token_in_rank.data_as<const std::uint8_t>();
    if (!routed_by_ids) {
      if (R > engine::kMaxTopk)
        core::fail(ctx, "dispatch without topk_idx supports at most {} ranks (the group has {})", engine::kMaxTopk, R);
      for (int d = 0; d < R; ++d) {
        std::int32_t count = 0;
        for (std::int64_t t = 0; t < n; ++t) count += in_rank[t * R + d] != 0;
        if (count != args.num_tokens_per_rank.data_as<const std::int32_t>()[d])
          core::fail(ctx, "num_tokens_per_rank[{}] = {}, but is_token_in_rank sends {} tokens there", d,
                     args.num_tokens_per_rank.data_as<const std::int32_t>()[d], count);
      }
      return;
    }
    // With topk_idx, the layout must be the one get_dispatch_layout computes from it.
    core::expect_tensor(ctx, "topk_idx", args.topk_idx, DType::kInt64, {n, -1});
    core::expect_rows_contiguous(ctx, "topk_idx", args.topk_idx);
    const int k = core::int_size(ctx, "topk_idx", args.topk_idx, 1);
    if (k < 1 || k > engine::kMaxTopk) core::fail(ctx, "topk_idx has {} columns (k), expected 1 to {}", k, engine::kMaxTopk);
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
    for (std::int64_t t = 0; t < n; ++t)
      for (int d = 0; d < R; ++d) {
        bool expected = false;
        for (int j = 0; j < k; ++j) expected |= rows.row(static_cast<int>(t))[j] >= 0 && geo.rank_of_expert(rows.row(static_cast<int>(t))[j]) == d;
        if ((in_rank[t * R + d] != 0) != expected)
          core::fail(ctx, "is_token_in_rank[{}, {}] = {}, but topk_idx {} an expert of rank {} for token {}", t, d,
                     in_rank[t * R + d] != 0, expected ? "names" : "names no", d, t);
      }
  };
  std::shared_ptr<LegacyHandle> legacy_handle;
  if (!cached) {
    legacy_handle = std::make_shared<LegacyHandle>();
    legacy_handle->num_channels = std::max(1, config.num_sms / 2);
    const TensorView in_rank = args.is_token_in_rank;
    const int rank = e.rank;
    r.on_complete = [legacy_handle, rank, nodes, in_rank](const EPHandle& h) {
      fill_legacy_handle(*legacy_handle, h, rank, nodes, in_rank);
    };
  }
  if (nodes > 1) core_->normal_call_used_pool();
  DispatchResult done = e.execute(engine::make_dispatch(e, std::move(r), e.next_sequence()), args.async_finish);
  LegacyDispatchResult out;
  if (is_nvfp4) {
    out.recv_x_nvfp4 = *nvfp4_out;  // allocated with the outputs; filled when the call completes
  } else {
    out.recv_x = done.recv_x;
  }
  out.recv_x_scales = done.recv_x_scales;
  out.event = done.event;
  if (cached) return out;  // DeepEP returns only x (and scales) from a cached dispatch
  if (routed_by_ids) {
    out.recv_topk_idx = done.recv_topk_idx;
    out.recv_topk_weights = done.recv_topk_weights;
  }
  out.num_recv_tokens_per_expert_list = done.handle->num_recv_tokens_per_expert_list;
  legacy_handle->routing = done.handle;
  out.handle = legacy_handle;
  return out;
}

CombineResult Buffer::combine(const LegacyCombineArgs& args) {
  auto& e = core_->engine;
  e.check_usable("combine");
  const Config config = args.config.value_or(get_combine_config(e.num_ranks));
  engine::CombineRequest r;
  r.rejection = args.rejection;
  r.x = args.x;
  r.handle = args.handle ? args.handle->routing : nullptr;
  r.topk_weights = args.topk_weights;
  r.bias = args.bias;
  r.workers = config_workers(e, config);
  r.previous_event = args.previous_event;
  r.async = args.async_finish;
  r.sum_weights_over_ranks = true;
  if (e.physical.num_scaleout > 1) core_->normal_call_used_pool();
  return e.execute(engine::make_combine(e, std::move(r), e.next_sequence()), args.async_finish);
}

LowLatencyDispatchResult Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& args) {
  return legacy::low_latency_dispatch(*core_, args);
}
LowLatencyCombineResult Buffer::low_latency_combine(const LowLatencyCombineArgs& args) {
  return legacy::low_latency_combine(*core_, args);
}
TensorView Buffer::get_next_low_latency_combine_buffer(const LowLatencyHandle& handle) {
  return legacy::next_combine_buffer(*core_, handle);
}
void Buffer::clean_low_latency_buffer(int max_tokens, int hidden, int num_experts) {
  legacy::clean_low_latency_buffer(*core_, max_tokens, hidden, num_experts);
}

void Buffer::barrier() { core_->engine.barrier(); }
void Buffer::destroy() {
  if (!core_->config.explicitly_destroy)
    throw StateError(fmt::format("{}: destroy() requires explicitly_destroy = true", core_->engine.context("destroy")));
  core_->engine.destroy();
}
int Buffer::rank() const { return core_->engine.rank; }
int Buffer::num_ranks() const { return core_->engine.num_ranks; }
std::pair<int, int> Buffer::get_physical_domain_size() const {
  return {core_->engine.physical.num_scaleout, core_->engine.physical.num_scaleup};
}
const BufferConfig& Buffer::config() const { return core_->config; }

}  // namespace moe_ep
