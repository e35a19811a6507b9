// Buffer (DeepEP V1): configuration, layout, and the normal-mode combine on the shared engine.
// The normal-mode dispatch is in legacy_dispatch.cc; low-latency mode in low_latency*.cc.
#include "moe_ep/legacy_buffer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "core/arith.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "core/executor.hh"
#include "core/fabric.hh"
#include "core/host_allocator.hh"
#include "core/log.hh"
#include "core/timeout.hh"
#include "legacy/buffer_core.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"
#include "routing/plan.hh"

namespace moe_ep {
namespace {

std::atomic<int> g_num_sms{20};

void check_num_sms_value(const std::string& context, int num_sms) {
  if (num_sms < 2 || num_sms > kMaxWorkers || num_sms % 2 != 0)
    core::fail(context, "num_sms = {} must be an even number in [2, {}]", num_sms, kMaxWorkers);
}

void check_pool(const std::string& context, const char* name, std::int64_t bytes) {
  if (bytes < 0 || bytes % 128 != 0) core::fail(context, "{} = {} must be a non-negative multiple of 128", name, bytes);
}

std::exception_ptr check_config(const std::string& context, const BufferConfig& c) {
  return core::attempt(context, [&] {
    check_pool(context, "num_nvl_bytes", c.num_nvl_bytes);
    check_pool(context, "num_rdma_bytes", c.num_rdma_bytes);
    if (c.num_qps_per_rank < 1) core::fail(context, "num_qps_per_rank = {} must be at least 1", c.num_qps_per_rank);
    core::checked_timeout(context, "num_cpu_timeout_secs", c.num_cpu_timeout_secs);
  });
}

// DeepEP runs up to this many ranks within one node, where normal mode needs no RDMA buffer (its
// size hint is 0 there).
constexpr int kDeepEPNodeRanks = 8;

engine::EngineConfig engine_config(const BufferConfig& c, const Group& group) {
  engine::EngineConfig e;
  e.name = "Buffer";
  e.pool_bytes = std::max<std::int64_t>(c.num_rdma_bytes, 0);
  // moe-ep's topology spans nodes (MOE_EP_RANKS_PER_NODE, two hosts) where DeepEP would keep every
  // rank in one node: engines size num_rdma_bytes by DeepEP's hints (0), so the Buffer provides
  // the scale-out pool of normal mode itself (docs/legacy.md §1).
  e.grow_pool = group.transport().topology().num_scaleout > 1 && group.size() <= kDeepEPNodeRanks;
  e.pool_alignment = 128;
  e.allow_hybrid_mode = true;  // across nodes V1 always sends each token once per node
  e.allow_multiple_reduction = true;
  e.num_allocated_qps = core::cap_inflight(std::max(c.num_qps_per_rank, 1));
  // A rejected configuration still takes part in the construction agreement, with a sane wait.
  e.timeout_secs = std::isfinite(c.num_cpu_timeout_secs) && c.num_cpu_timeout_secs > 0 ? c.num_cpu_timeout_secs : 1;
  e.explicitly_destroy = c.explicitly_destroy;
  return e;
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
  if (rdma_send > 0) c.num_max_rdma_chunked_recv_tokens = core::round_up(rdma_recv, rdma_send);
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
  return core::round_up(bytes, 128);
}

std::int64_t Config::get_rdma_buffer_size_hint(std::int64_t hidden_bytes, int num_ranks) const {
  if (num_ranks <= kDeepEPNodeRanks) return 0;
  const std::int64_t C = num_sms / 2, Nr = num_ranks / 8, T = num_max_rdma_chunked_recv_tokens;
  const std::int64_t bytes =
      C * Nr * (8 * 2 + 2) * 2 * 4 + 2 * C * Nr * T * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16);
  return core::round_up(bytes, 128);
}

void ReceiveHook::operator()() const {
  if (!receive_) throw StateError("this receive hook is empty (the call was made without return_recv_hook)");
  (*receive_)();
}

// ---- BufferCore --------------------------------------------------------------------------------

namespace legacy {

BufferCore::BufferCore(Group& group, const BufferConfig& cfg)
    : config(cfg),
      engine(group, engine_config(cfg, group), check_config(fmt::format("[rank {}] Buffer", group.rank()), cfg),
             [&](comm::Agreement& a) {
               a.field("num_nvl_bytes", cfg.num_nvl_bytes)
                   .field("num_rdma_bytes", cfg.num_rdma_bytes)
                   .field("low_latency_mode", cfg.low_latency_mode)
                   .field("num_qps_per_rank", cfg.num_qps_per_rank)
                   .field("enable_shrink", cfg.enable_shrink);
             }),
      masked(std::make_unique<std::atomic<std::int32_t>[]>(static_cast<std::size_t>(group.size()))),
      failed(std::make_unique<std::atomic<std::int32_t>[]>(static_cast<std::size_t>(group.size()))) {
  // Shrink mode's exchange: agreement blocks of a header, the signature fields and the largest
  // payload, a low-latency dispatch's counts (experts + 1 + ranks int32).
  if (cfg.enable_shrink && cfg.low_latency_mode)
    engine.make_tolerant(1024 + 4 * (static_cast<std::size_t>(kMaxShrinkExperts) + 1 + static_cast<std::size_t>(group.size())));
  core::info(core::Subsys::kInit,
             "Buffer #{}: num_nvl_bytes {}, num_rdma_bytes {} (the symmetric pool), low_latency_mode {}, "
             "num_qps_per_rank {} ({} used)",
             engine.facts.id, cfg.num_nvl_bytes, cfg.num_rdma_bytes, cfg.low_latency_mode, cfg.num_qps_per_rank,
             engine.facts.config.num_allocated_qps);
}

std::vector<char> BufferCore::counted_on() const {
  if (!(config.enable_shrink && config.low_latency_mode)) return {};
  std::vector<char> live(static_cast<std::size_t>(engine.facts.num_ranks));
  for (std::size_t r = 0; r < live.size(); ++r) live[r] = failed[r].load(std::memory_order_relaxed) == 0;
  live[static_cast<std::size_t>(engine.facts.rank)] = 1;
  return live;
}

void BufferCore::mark_failed(int rank, const std::string& why) {
  masked[static_cast<std::size_t>(rank)].store(1, std::memory_order_relaxed);
  if (failed[static_cast<std::size_t>(rank)].exchange(1, std::memory_order_relaxed) == 0)
    core::warn(core::Subsys::kP2P, "Buffer #{}: shrink mode masks rank {}: {}", engine.facts.id, rank, why);
}

void BufferCore::fail_wait(const std::exception_ptr& error) {
  if (!(config.enable_shrink && config.low_latency_mode)) engine.leave(error);
  const std::string why = comm::message_of(error);
  for (int r : comm::culprits_of(error))
    if (r >= 0 && r < engine.facts.num_ranks && r != engine.facts.rank) mark_failed(r, why);
  std::rethrow_exception(error);
}

std::function<int(int, int)> normal_mode_workers(const engine::Engine& e, const Config& config) {
  const int channels = std::max(1, config.num_sms / 2);
  const int cap = e.cores_per_rank();
  return [channels, cap](int, int) { return std::min(channels, cap); };
}

void check_comm_stream_flags(const std::string& ctx, bool allocate_on_comm_stream, bool has_previous_event,
                             bool async_finish) {
  if (allocate_on_comm_stream && !(has_previous_event && async_finish))
    core::fail(ctx, "allocate_on_comm_stream = true requires previous_event and async_finish = true (previous_event "
               "{}, async_finish = {})", has_previous_event ? "given" : "missing", async_finish);
}

}  // namespace legacy

// ---- Buffer ------------------------------------------------------------------------------------

Buffer::Buffer(Group& group, const BufferConfig& config) : core_(std::make_unique<legacy::BufferCore>(group, config)) {}
// Under the call lock: a call or receive hook still running on another thread ends first, and a
// hook called later finds the buffer gone.
Buffer::~Buffer() {
  const std::shared_ptr<std::recursive_mutex> calls = core_->calls;
  std::lock_guard lock(*calls);
  core_.reset();
}

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
  const std::int64_t signal = core::round_up(4 * std::int64_t{E}, 128);
  const std::int64_t total = 2 * signal + 2 * send + 2 * recv;
  const std::int64_t deepep = (total + 128) / 128 * 128;  // DeepEP adds 128 even to an exact multiple
  // Ours fits in DeepEP's size except for very few experts; never hand out less than we need.
  return std::max(deepep, core::round_up(legacy::SlotLayout::pool_bytes(N, H, R, E), 128));
}

DispatchLayout Buffer::get_dispatch_layout(const TensorView& topk_idx, int num_experts,
                                           std::optional<Event> previous_event, bool async_finish,
                                           bool allocate_on_comm_stream) {
  std::lock_guard lock(*core_->calls);
  auto& e = core_->engine;
  e.check_usable("get_dispatch_layout");
  const std::string ctx = e.facts.context("get_dispatch_layout");
  core::expect_tensor(ctx, "topk_idx", topk_idx, DType::kInt64, {-1, -1});
  core::expect_contiguous(ctx, "topk_idx", topk_idx);
  const int n = core::int_size(ctx, "topk_idx", topk_idx, 0), k = core::int_size(ctx, "topk_idx", topk_idx, 1);
  if (k < 1 || k > kMaxTopk) core::fail(ctx, "topk_idx has {} columns (k), expected 1 to {}", k, kMaxTopk);
  if (num_experts <= 0 || num_experts % e.facts.num_ranks != 0)
    core::fail(ctx, "num_experts = {} must be a positive multiple of the {} ranks", num_experts, e.facts.num_ranks);
  const routing::TopkRows rows{topk_idx.data_as<const std::int64_t>(), topk_idx.stride(0), n, k};
  routing::validate_topk(ctx, rows, num_experts);
  legacy::check_comm_stream_flags(ctx, allocate_on_comm_stream, previous_event.has_value(), async_finish);
  e.wait_for_event(previous_event, ctx, "previous_event");
  const int R = e.facts.num_ranks, nodes = e.facts.physical.num_scaleout;
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
  return out;
}

CombineResult Buffer::combine(const LegacyCombineArgs& args) {
  std::lock_guard lock(*core_->calls);
  auto& e = core_->engine;
  e.check_usable("combine");
  const Config config = args.config.value_or(get_combine_config(e.facts.num_ranks));
  engine::CombineRequest r;
  r.rejection = args.rejection;
  r.x = args.x;
  r.handle = args.handle ? args.handle->routing : nullptr;
  r.topk_weights = args.topk_weights;
  r.bias = args.bias;
  r.workers = legacy::normal_mode_workers(e, config);
  r.previous_event = args.previous_event;
  r.async = args.async_finish;
  r.sum_weights_over_ranks = true;
  r.check_generation_arguments = [allocate = args.allocate_on_comm_stream, previous = args.previous_event.has_value(),
                     async = args.async_finish](const std::string& ctx) {
    legacy::check_comm_stream_flags(ctx, allocate, previous, async);
  };
  if (e.facts.physical.num_scaleout > 1) core_->normal_call_used_pool();
  return e.execute(engine::make_combine(e, std::move(r), e.next_sequence()), args.async_finish);
}

LowLatencyDispatchResult Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& args) {
  std::lock_guard lock(*core_->calls);
  return legacy::low_latency_dispatch(*core_, args);
}
LowLatencyCombineResult Buffer::low_latency_combine(const LowLatencyCombineArgs& args) {
  std::lock_guard lock(*core_->calls);
  return legacy::low_latency_combine(*core_, args);
}
Tensor Buffer::get_next_low_latency_combine_buffer(const LowLatencyHandle& handle) {
  std::lock_guard lock(*core_->calls);
  const TensorView view = legacy::next_combine_buffer(*core_, handle);
  return core_->pool_storage().with_view(view);
}
void Buffer::clean_low_latency_buffer(int max_tokens, int hidden, int num_experts, const std::string& rejection) {
  std::lock_guard lock(*core_->calls);
  legacy::clean_low_latency_buffer(*core_, max_tokens, hidden, num_experts, rejection);
}

Tensor legacy::BufferCore::pool_storage() {
  std::shared_ptr<comm::SymmetricMemory> memory = engine.memory_owner();
  std::byte* base = memory->local();
  const std::size_t bytes = memory->bytes();
  return Tensor::adopt(std::move(memory), base, bytes);
}

std::shared_ptr<void> legacy::BufferCore::nvl_buffer() {
  std::lock_guard lock(mutex_);
  if (!nvl_buffer_ && config.num_nvl_bytes > 0) {
    const auto bytes = static_cast<std::size_t>(config.num_nvl_bytes);
    nvl_buffer_ = core::allocate_host(bytes);
    core::zero_host_sparse(nvl_buffer_.get(), bytes);
  }
  return nvl_buffer_;
}

Tensor Buffer::get_local_buffer_tensor(DType dtype, std::int64_t offset, bool use_rdma_buffer) {
  std::lock_guard lock(*core_->calls);
  engine::Engine& e = core_->engine;
  const std::string ctx = e.facts.context("get_local_buffer_tensor");
  e.check_usable("get_local_buffer_tensor");
  const char* pool = use_rdma_buffer ? "num_rdma_bytes" : "num_nvl_bytes";
  const std::int64_t bytes = use_rdma_buffer ? core_->config.num_rdma_bytes : core_->config.num_nvl_bytes;
  const auto size = static_cast<std::int64_t>(element_size(dtype));
  if (offset < 0 || offset > bytes)
    core::fail(ctx, "offset = {} is outside [0, {} = {}]", offset, pool, bytes);
  if (offset % size != 0)
    core::fail(ctx, "offset = {} is not a multiple of the {} bytes of {}", offset, size, dtype_name(dtype));
  Tensor storage;
  if (use_rdma_buffer) {
    storage = core_->pool_storage();
  } else if (std::shared_ptr<void> nvl = core_->nvl_buffer()) {
    storage = Tensor::adopt(nvl, nvl.get(), static_cast<std::size_t>(bytes));
  } else {
    return Tensor::empty({0}, dtype);  // num_nvl_bytes = 0
  }
  const std::int64_t count = (bytes - offset) / size;
  return storage.with_view(TensorView(static_cast<std::byte*>(storage.data()) + offset, dtype, {count}));
}

namespace {
std::string shrink_context(legacy::BufferCore& core, const char* operation) {
  std::string ctx = core.engine.facts.context(operation);
  core.engine.check_usable(operation);
  if (!core.config.enable_shrink) throw StateError(fmt::format("{}: the buffer was built with enable_shrink = false", ctx));
  return ctx;
}
}  // namespace

void Buffer::low_latency_update_mask_buffer(int rank_to_mask, bool mask) {
  std::lock_guard lock(*core_->calls);
  const std::string ctx = shrink_context(*core_, "low_latency_update_mask_buffer");
  if (rank_to_mask < 0 || rank_to_mask >= num_ranks())
    core::fail(ctx, "rank_to_mask = {} is outside [0, {})", rank_to_mask, num_ranks());
  core_->masked[static_cast<std::size_t>(rank_to_mask)].store(mask ? 1 : 0, std::memory_order_relaxed);
  if (!mask) core_->failed[static_cast<std::size_t>(rank_to_mask)].store(0, std::memory_order_relaxed);
}

void Buffer::low_latency_query_mask_buffer(const TensorView& mask_status) {
  std::lock_guard lock(*core_->calls);
  const std::string ctx = shrink_context(*core_, "low_latency_query_mask_buffer");
  core::expect_tensor(ctx, "mask_status", mask_status, DType::kInt32, {num_ranks()});
  for (int r = 0; r < num_ranks(); ++r)
    mask_status.data_as<std::int32_t>()[r * mask_status.stride(0)] =
        core_->masked[static_cast<std::size_t>(r)].load(std::memory_order_relaxed);
}

void Buffer::low_latency_clean_mask_buffer() {
  std::lock_guard lock(*core_->calls);
  shrink_context(*core_, "low_latency_clean_mask_buffer");
  for (int r = 0; r < num_ranks(); ++r) {
    core_->masked[static_cast<std::size_t>(r)].store(0, std::memory_order_relaxed);
    core_->failed[static_cast<std::size_t>(r)].store(0, std::memory_order_relaxed);
  }
}

void Buffer::barrier() {
  std::lock_guard lock(*core_->calls);
  core_->engine.barrier();
}
void Buffer::destroy() {
  std::lock_guard lock(*core_->calls);
  if (!core_->config.explicitly_destroy)
    throw StateError(fmt::format("{}: destroy() requires explicitly_destroy = true", core_->engine.facts.context("destroy")));
  core_->engine.destroy();
}
int Buffer::rank() const { return core_->engine.facts.rank; }
int Buffer::num_ranks() const { return core_->engine.facts.num_ranks; }
std::pair<int, int> Buffer::get_physical_domain_size() const {
  return {core_->engine.facts.physical.num_scaleout, core_->engine.facts.physical.num_scaleup};
}
const BufferConfig& Buffer::config() const { return core_->config; }

}  // namespace moe_ep
