// TokenDispatcher: options, the per-micro-batch stage machine, and the four paths (V1 normal,
// V1 low-latency, V2 normal, V2 low-latency) behind one set of output formats.
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "core/checks.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "core/timeout.hh"
#include "dispatcher/provider_registry.hh"
#include "dispatcher/state.hh"
#include "dispatcher/v2_slab.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/dispatcher.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "routing/plan.hh"

namespace moe_ep {

const char* generation_name(Generation g) { return g == Generation::kV1 ? "V1" : "V2"; }

const char* mode_name(DispatchMode m) {
  switch (m) {
    case DispatchMode::kNormal:
      return "normal";
    case DispatchMode::kLowLatency:
      return "low_latency";
    case DispatchMode::kAuto:
      return "auto";
  }
  return "?";
}

const char* format_name(OutputFormat f) {
  switch (f) {
    case OutputFormat::kNormal:
      return "normal";
    case OutputFormat::kLowLatency:
      return "low_latency";
    case OutputFormat::kV2Expanded:
      return "v2_expanded";
  }
  return "?";
}

namespace dispatcher {
namespace {

constexpr int kMaxTopk = 32;

enum class Stage { kIdle, kDispatching, kDispatched, kCombining };

const char* stage_text(Stage s) {
  switch (s) {
    case Stage::kIdle:
      return "idle";
    case Stage::kDispatching:
      return "between dispatch_a and dispatch_b";
    case Stage::kDispatched:
      return "dispatched (holding a handle until its combine)";
    case Stage::kCombining:
      return "between combine_a and combine_b";
  }
  return "?";
}

const char* expected_call(Stage s) {
  switch (s) {
    case Stage::kIdle:
      return "dispatch_a (or dispatch)";
    case Stage::kDispatching:
      return "dispatch_b";
    case Stage::kDispatched:
      return "combine_a (or combine)";
    case Stage::kCombining:
      return "combine_b";
  }
  return "?";
}

// One micro-batch: its stage, the tensors it keeps alive and the buffer results it holds.
struct Slot {
  Stage stage = Stage::kIdle;
  bool holds = false;  // counted in CacheState::holders
  std::uint64_t buffer_id = 0;
  DispatchMode mode = DispatchMode::kNormal;
  OutputFormat format = OutputFormat::kNormal;
  Generation generation = Generation::kV1;
  std::string provider;
  int num_tokens = 0;
  Tensor x, topk_idx, topk_weights, x_fp8, x_scales, global_scale;
  DispatchLayout layout;  // V1 normal: read by the asynchronous dispatch
  LegacyDispatchResult v1;
  LowLatencyDispatchResult ll;
  DispatchResult v2;
  V2Slab slab;
  Tensor combine_input, expanded;
  CombineResult combined;
  LowLatencyCombineResult ll_combined;
};

// ---- Options ----------------------------------------------------------------------------------

template <class T>
T pick(const std::optional<T>& field, T from_env) {
  return field.has_value() ? *field : from_env;
}

// Names where a value came from: the field when set, else the environment variable.
std::string origin(bool from_field, const char* field, const char* variable) {
  return from_field ? fmt::format("DispatcherOptions.{}", field) : std::string(variable);
}

void check_range(const std::string& name, std::int64_t value, std::int64_t lo, std::int64_t hi) {
  if (value < lo || value > hi)
    throw InvalidArgument(fmt::format("dispatcher: {} = {} is out of range: expected {} to {}", name, value, lo, hi));
}

// An option that sets the same quantity as an environment variable has the variable's range.
void check_variable_range(bool from_field, const char* field, const char* variable, std::int64_t value) {
  const env::IntRange& range = env::lookup(variable).int_range;
  check_range(origin(from_field, field, variable), value, range.min, range.max);
}

DispatcherOptions resolve_options(const DispatcherOptions& in, const Group& group) {
  DispatcherOptions o = in;
  o.use_v2 = pick(in.use_v2, env::get_bool("MOE_EP_USE_V2"));
  if (!in.mode) {
    const std::string m = env::get_string("MOE_EP_MODE");
    o.mode = m == "normal" ? DispatchMode::kNormal : m == "low_latency" ? DispatchMode::kLowLatency : DispatchMode::kAuto;
  }
  // The variables' ranges are the limits of these options (checked below for option fields);
  // values read from the environment are in range.
  o.num_max_dispatch_tokens_per_rank = pick(
      in.num_max_dispatch_tokens_per_rank, static_cast<int>(env::get_int("MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK")));
  o.num_max_prefill_tokens_per_rank = pick(
      in.num_max_prefill_tokens_per_rank, static_cast<int>(env::get_int("MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK")));
  if (!in.dispatch_dtype) {
    const std::string d = env::get_string("MOE_EP_DISPATCH_DTYPE");
    o.dispatch_dtype = d == "fp8" ? WireDType::kFP8 : d == "nvfp4" ? WireDType::kNVFP4 : WireDType::kBF16;
  }
  o.num_workers = pick(in.num_workers, static_cast<int>(env::get_int("MOE_EP_NUM_WORKERS")));
  o.allow_hybrid_mode = pick(in.allow_hybrid_mode, env::get_bool("MOE_EP_V2_ALLOW_HYBRID_MODE"));
  o.allow_multiple_reduction = pick(in.allow_multiple_reduction, env::get_bool("MOE_EP_V2_ALLOW_MULTIPLE_REDUCTION"));
  o.v2_expanded_normal_layout = pick(in.v2_expanded_normal_layout, env::get_string("MOE_EP_V2_NORMAL_LAYOUT") == "expanded");
  o.timeout_secs = in.timeout_secs ? *in.timeout_secs : core::timeout_from_env();
  o.provider_path = pick(in.provider_path, env::get_string("MOE_EP_PROVIDER_PATH"));
  if (!*o.use_v2)
    for (const char* name :
         {"MOE_EP_V2_ALLOW_HYBRID_MODE", "MOE_EP_V2_ALLOW_MULTIPLE_REDUCTION", "MOE_EP_V2_NORMAL_LAYOUT"})
      if (env::current(name).source == env::Source::kEnvironment)
        core::warn(core::Subsys::kEnv, "dispatcher: {} is set but the dispatcher uses V1 (MOE_EP_USE_V2 / "
                   "DispatcherOptions.use_v2 off): ignored", name);

  const int R = group.size();
  check_range("DispatcherOptions.hidden", o.hidden, 1, 1 << 24);
  check_range("DispatcherOptions.num_topk", o.num_topk, 1, kMaxTopk);
  check_range("DispatcherOptions.num_experts", o.num_experts, 1, 1 << 20);
  if (o.num_experts % R != 0)
    throw InvalidArgument(fmt::format("dispatcher: DispatcherOptions.num_experts = {} is not divisible by the {} ranks",
                                      o.num_experts, R));
  check_variable_range(in.num_max_dispatch_tokens_per_rank.has_value(), "num_max_dispatch_tokens_per_rank",
                       "MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", *o.num_max_dispatch_tokens_per_rank);
  check_variable_range(in.num_max_prefill_tokens_per_rank.has_value(), "num_max_prefill_tokens_per_rank",
                       "MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK", *o.num_max_prefill_tokens_per_rank);
  check_variable_range(in.num_workers.has_value(), "num_workers", "MOE_EP_NUM_WORKERS", *o.num_workers);
  check_range("DispatcherOptions.expert_alignment", o.expert_alignment, 1, 1 << 20);
  core::checked_timeout("dispatcher", "DispatcherOptions.timeout_secs", *o.timeout_secs);
  if (*o.dispatch_dtype == WireDType::kFP8 && o.hidden % kFp8BlockSize != 0)
    throw InvalidArgument(fmt::format("dispatcher: FP8 dispatch ({}) needs hidden to be a multiple of {}, got {}",
                                      origin(in.dispatch_dtype.has_value(), "dispatch_dtype", "MOE_EP_DISPATCH_DTYPE"),
                                      kFp8BlockSize, o.hidden));
  if (*o.dispatch_dtype == WireDType::kNVFP4) {
    const std::string from = origin(in.dispatch_dtype.has_value(), "dispatch_dtype", "MOE_EP_DISPATCH_DTYPE");
    if (o.hidden % 128 != 0)
      throw InvalidArgument(fmt::format("dispatcher: NVFP4 dispatch ({}) needs hidden to be a multiple of 128, got {}",
                                        from, o.hidden));
    if (*o.mode == DispatchMode::kNormal)
      throw InvalidArgument(fmt::format("dispatcher: NVFP4 dispatch ({}) is the low-latency wire format; mode = normal "
                                        "(MOE_EP_MODE or DispatcherOptions.mode) would send none: use low_latency or "
                                        "auto (prefill batches then travel BF16)", from));
    if (!o.nvfp4_use_ue8m0 && !(std::isfinite(o.nvfp4_global_scale) && o.nvfp4_global_scale > 0.0f))
      throw InvalidArgument(fmt::format("dispatcher: DispatcherOptions.nvfp4_global_scale = {} must be a positive "
                                        "finite number", o.nvfp4_global_scale));
  }
  if (o.use_ue8m0 && !o.round_scale)
    throw InvalidArgument("dispatcher: DispatcherOptions.use_ue8m0 = true needs round_scale = true");
  // The V2 low-latency slab: R x cap rows per expert, row indices in int32.
  if (std::int64_t{R} * *o.num_max_dispatch_tokens_per_rank * (o.num_experts / R + o.num_topk) > (std::int64_t{1} << 31) - 1)
    throw InvalidArgument(fmt::format("dispatcher: {} = {} with {} ranks gives slabs beyond the int32 row index",
                                      origin(in.num_max_dispatch_tokens_per_rank.has_value(),
                                             "num_max_dispatch_tokens_per_rank", "MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"),
                                      *o.num_max_dispatch_tokens_per_rank, R));
  return o;
}

}  // namespace

// ---- Dispatcher state -------------------------------------------------------------------------

class DispatcherState {
 public:
  DispatcherState(BufferCache& c, CacheState& cs, const DispatcherOptions& o)
      : cache(c), shared(cs), options(resolve_options(o, cs.group)) {}

  BufferCache& cache;
  CacheState& shared;
  DispatcherOptions options;  // resolved
  Slot slots[TokenDispatcher::kMicroBatches];
  std::vector<std::pair<HookPoint, std::function<void(const HookInfo&)>>> hooks;

  Generation generation() const { return *options.use_v2 ? Generation::kV2 : Generation::kV1; }
  DispatchMode resolve(BatchKind kind) const {
    if (*options.mode != DispatchMode::kAuto) return *options.mode;
    return kind == BatchKind::kPrefill ? DispatchMode::kNormal : DispatchMode::kLowLatency;
  }
  int cap() const { return *options.num_max_dispatch_tokens_per_rank; }
  bool fp8() const { return *options.dispatch_dtype == WireDType::kFP8; }
  // NVFP4 applies to low-latency batches only.
  bool nvfp4(const Slot& s) const { return *options.dispatch_dtype == WireDType::kNVFP4 && s.mode == DispatchMode::kLowLatency; }
  int ranks() const { return shared.group.size(); }
  int local_experts() const { return options.num_experts / ranks(); }

  BufferKey key() const {
    BufferKey k;
    k.generation = generation();
    const GenerationProbe& probe = probe_providers(*options.provider_path)[k.generation];
    k.provider = probe.available ? probe.origin : "";
    k.world = ranks();
    k.hidden = options.hidden;
    k.topk = options.num_topk;
    k.cap = cap();
    k.prefill_cap = *options.num_max_prefill_tokens_per_rank;
    k.fp8 = fp8();
    k.nvfp4 = *options.dispatch_dtype == WireDType::kNVFP4 && k.generation == Generation::kV2;
    k.timeout_secs = *options.timeout_secs;
    if (k.generation == Generation::kV2) {
      k.hybrid = *options.allow_hybrid_mode;
      k.multiple_reduction = *options.allow_multiple_reduction;
    } else {
      k.low_latency = *options.mode != DispatchMode::kNormal;
      k.experts = options.num_experts;
    }
    return k;
  }

  Slot& slot(int micro_batch, const char* call) {
    if (micro_batch < 0 || micro_batch >= TokenDispatcher::kMicroBatches)
      throw InvalidArgument(fmt::format("dispatcher: {}: micro_batch = {} is out of range: expected 0 to {}", call,
                                        micro_batch, TokenDispatcher::kMicroBatches - 1));
    return slots[micro_batch];
  }

  void expect_stage(const Slot& s, int micro_batch, Stage want, const char* call) const {
    if (s.stage == want) return;
    if (want == Stage::kIdle && s.stage == Stage::kDispatched)
      throw StateError(fmt::format("dispatcher: {}: micro-batch {} still holds the handle of its previous dispatch: "
                                   "combine it first (one live handle per micro-batch)",
                                   call, micro_batch));
    throw StateError(fmt::format("dispatcher: {} called out of order: micro-batch {} is {}; the next call must be {}",
                                 call, micro_batch, stage_text(s.stage), expected_call(s.stage)));
  }

  // Returns the slot to idle and releases everything it holds (also after failures).
  void release(Slot& s) {
    if (s.holds) --shared.holders;
    s = Slot{};
  }

  void run_hooks(HookPoint point, int micro_batch, DispatchMode mode) {
    for (auto& [p, fn] : hooks)
      if (p == point) fn({point, micro_batch, mode});
  }

  void validate_dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, DispatchMode mode) const;
  void start_dispatch(Slot& s);
  DispatchOutput finish_dispatch(Slot& s, int micro_batch);
  void validate_combine(const Slot& s, const Tensor& y) const;
  void start_combine(Slot& s);
  Tensor finish_combine(Slot& s);
};

void DispatcherState::validate_dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                        DispatchMode mode) const {
  const std::string ctx = fmt::format("[rank {}] dispatcher: dispatch", shared.group.rank());
  core::expect_tensor(ctx, "x", x, DType::kBF16, {-1, options.hidden});
  core::expect_rows_contiguous(ctx, "x", x);
  const std::int64_t n = x.size(0);
  const bool low_latency = mode == DispatchMode::kLowLatency;
  const std::int64_t limit = low_latency ? cap() : *options.num_max_prefill_tokens_per_rank;
  if (n > limit)
    core::fail(ctx, "{} tokens exceed the {} token cap of {} = {}; raise {}", n, mode_name(mode),
               low_latency ? "MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK" : "MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK",
               limit, low_latency ? "MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK" : "MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK");
  core::expect_tensor(ctx, "topk_idx", topk_idx, DType::kInt64, {n, options.num_topk});
  core::expect_rows_contiguous(ctx, "topk_idx", topk_idx);
  core::expect_tensor(ctx, "topk_weights", topk_weights, DType::kFP32, {n, options.num_topk});
  core::expect_rows_contiguous(ctx, "topk_weights", topk_weights);
  routing::validate_topk(ctx, {topk_idx.data_as<const std::int64_t>(), topk_idx.stride(0), static_cast<int>(n),
                               options.num_topk},
                         options.num_experts);
}

void DispatcherState::start_dispatch(Slot& s) {
  const int E = options.num_experts, H = options.hidden;
  if (fp8() && !(s.generation == Generation::kV1 && s.mode == DispatchMode::kLowLatency)) {
    // Quantized before sending (V1 low-latency casts inside the buffer, with the same rule).
    Fp8Tensor q = quantize_fp8(s.x, {.round_scale = options.round_scale, .use_ue8m0 = options.use_ue8m0});
    s.x_fp8 = q.data;
    s.x_scales = q.scales;
  }
  TensorView x = fp8() ? s.x_fp8.view() : s.x.view();
  if (nvfp4(s) && s.generation == Generation::kV2) {
    // V2 moves bytes: the E2M1 pairs as H/2 one-byte elements, the scale bytes as H/64 words.
    const Nvfp4Tensor q = quantize_nvfp4(s.x, {.global_scale = options.nvfp4_global_scale,
                                               .use_ue8m0_for_sf = options.nvfp4_use_ue8m0});
    const std::int64_t n = s.x.size(0);
    s.x_fp8 = q.data.with_view(TensorView(q.data.data(), DType::kFP8E4M3, {n, H / 2}));
    s.x_scales = q.scales.with_view(TensorView(q.scales.data(), DType::kInt32, {n, H / 64}));
    x = s.x_fp8;
  }
  if (s.generation == Generation::kV1) {
    provider::LegacyBackend& b = *shared.legacy();
    if (s.mode == DispatchMode::kNormal) {
      s.layout = b.get_dispatch_layout(s.topk_idx, E);
      const DispatchLayout& layout = s.layout;
      Config config = Buffer::get_dispatch_config(ranks());
      if (*options.num_workers > 0) config.num_sms = 2 * *options.num_workers;
      LegacyDispatchArgs a{.x = x,
                           .num_tokens_per_rank = layout.num_tokens_per_rank,
                           .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                           .is_token_in_rank = layout.is_token_in_rank,
                           .num_tokens_per_expert = layout.num_tokens_per_expert,
                           .topk_idx = s.topk_idx,
                           .topk_weights = s.topk_weights,
                           .expert_alignment = options.expert_alignment,
                           .config = config,
                           .async_finish = true};
      if (fp8()) a.x_scales = s.x_scales;
      shared.normal_since_clean = true;
      s.v1 = b.dispatch(a);
    } else {
      if (shared.normal_since_clean) {  // normal -> low-latency transition
        b.clean_low_latency_buffer(cap(), H, E);
        shared.normal_since_clean = false;
        ++shared.stats.clean_calls;
      }
      LowLatencyDispatchArgs a{.x = s.x,
                               .topk_idx = s.topk_idx,
                               .num_max_dispatch_tokens_per_rank = cap(),
                               .num_experts = E,
                               .use_fp8 = fp8(),
                               .round_scale = options.round_scale,
                               .use_ue8m0 = options.use_ue8m0,
                               .use_nvfp4 = nvfp4(s),
                               .use_ue8m0_for_sf = nvfp4(s) && options.nvfp4_use_ue8m0,
                               .return_recv_hook = true};
      if (nvfp4(s)) {
        s.global_scale = Tensor::empty({}, DType::kFP32);
        *s.global_scale.data_as<float>() = options.nvfp4_global_scale;
        a.x_global_scale = s.global_scale;
      }
      s.ll = b.low_latency_dispatch(a);
    }
    return;
  }
  provider::ElasticBackend& b = *shared.elastic();
  DispatchArgs a{.x = x,
                 .topk_idx = s.topk_idx,
                 .topk_weights = s.topk_weights,
                 .num_experts = E,
                 .expert_alignment = options.expert_alignment,
                 .num_sms = *options.num_workers,
                 .async_with_compute_stream = true,
                 .do_cpu_sync = true,
                 .do_expand = s.format == OutputFormat::kV2Expanded};
  if (fp8() || nvfp4(s)) a.x_scales = s.x_scales;
  if (s.mode == DispatchMode::kLowLatency) {
    // No host wait, static shapes: one aligned group of R x cap rows per non-empty expert.
    a.num_max_tokens_per_rank = cap();
    a.expert_alignment = ranks() * cap();
    a.do_cpu_sync = false;
    a.do_expand = true;
  }
  s.v2 = b.dispatch(a);
}

DispatchOutput DispatcherState::finish_dispatch(Slot& s, int micro_batch) {
  DispatchOutput out;
  out.format = s.format;
  out.generation = s.generation;
  out.mode = s.mode;
  out.provider = s.provider;
  out.micro_batch = micro_batch;
  const int R = ranks(), E = options.num_experts, k = options.num_topk;
  if (s.generation == Generation::kV1) {
    if (s.mode == DispatchMode::kNormal) {
      s.v1.event.wait();
      out.hidden_states = s.v1.recv_x;
      out.hidden_states_scale = s.v1.recv_x_scales;
      out.topk_ids = s.v1.recv_topk_idx;
      out.topk_weights = s.v1.recv_topk_weights;
      out.num_recv_tokens_per_expert = s.v1.num_recv_tokens_per_expert_list;
    } else {
      s.ll.hook();
      out.hidden_states = s.ll.recv_x;
      out.hidden_states_scale = s.ll.recv_x_scales;
      out.masked_m = s.ll.packed_recv_count;
      out.expected_m = (s.num_tokens * R * k + E) / E;
    }
    return out;
  }
  s.v2.event.wait();
  if (s.mode == DispatchMode::kNormal) {
    out.hidden_states = s.v2.recv_x;
    out.hidden_states_scale = s.v2.recv_x_scales;
    out.topk_ids = s.v2.recv_topk_idx;
    out.topk_weights = s.v2.recv_topk_weights;
    out.num_recv_tokens_per_expert = s.v2.handle->num_recv_tokens_per_expert_list;
    if (s.format == OutputFormat::kV2Expanded) out.masked_m = s.v2.handle->num_unaligned_recv_tokens_per_expert;
    if (s.format == OutputFormat::kNormal) {
      // V2's compact rows carry the token's full weight row; the normal format (V1's) has 0
      // where the expert lives elsewhere.
      const std::int64_t n = out.topk_ids.size(0) * out.topk_ids.size(1);
      for (std::int64_t i = 0; i < n; ++i)
        if (out.topk_ids.data_as<const std::int64_t>()[i] < 0) out.topk_weights.data_as<float>()[i] = 0.0f;
    }
    return out;
  }
  s.slab = make_slab(s.v2, local_experts(), R * cap());
  if (nvfp4(s)) to_nvfp4_layout(s.slab, options.hidden, options.nvfp4_use_ue8m0);
  out.hidden_states = s.slab.hidden_states;
  out.hidden_states_scale = s.slab.scales;
  out.masked_m = s.slab.masked_m;
  out.expected_m = (s.num_tokens * R * k + E) / E;
  return out;
}

void DispatcherState::validate_combine(const Slot& s, const Tensor& y) const {
  const std::string ctx = fmt::format("[rank {}] dispatcher: combine ({} format)", shared.group.rank(), format_name(s.format));
  std::int64_t rows = 0;
  switch (s.format) {
    case OutputFormat::kNormal:
      rows = s.generation == Generation::kV1 ? s.v1.recv_x.size(0) : s.v2.recv_x.size(0);
      break;
    case OutputFormat::kV2Expanded:
      rows = s.v2.recv_x.size(0);
      break;
    case OutputFormat::kLowLatency:
      core::expect_tensor(ctx, "expert_output", y, DType::kBF16, {local_experts(), std::int64_t{ranks()} * cap(), options.hidden});
      core::expect_rows_contiguous(ctx, "expert_output", y);
      return;
  }
  core::expect_tensor(ctx, "expert_output", y, DType::kBF16, {rows, options.hidden});
  core::expect_rows_contiguous(ctx, "expert_output", y);
}

void DispatcherState::start_combine(Slot& s) {
  if (s.generation == Generation::kV1) {
    provider::LegacyBackend& b = *shared.legacy();
    if (s.mode == DispatchMode::kNormal) {
      Config config = Buffer::get_combine_config(ranks());
      if (*options.num_workers > 0) config.num_sms = 2 * *options.num_workers;
      s.combined = b.combine({.x = s.combine_input, .handle = s.v1.handle, .config = config, .async_finish = true});
    } else {
      s.ll_combined = b.low_latency_combine({.x = s.combine_input,
                                             .topk_idx = s.topk_idx,
                                             .topk_weights = s.topk_weights,
                                             .handle = s.ll.handle,
                                             .return_recv_hook = true});
    }
    return;
  }
  provider::ElasticBackend& b = *shared.elastic();
  TensorView x = s.combine_input;
  if (s.mode == DispatchMode::kLowLatency) {
    s.expanded = slab_to_expanded(s.slab, s.v2, s.combine_input);
    x = s.expanded;
  }
  s.combined = b.combine({.x = x, .handle = s.v2.handle, .num_sms = *options.num_workers, .async_with_compute_stream = true});
}

Tensor DispatcherState::finish_combine(Slot& s) {
  if (s.generation == Generation::kV1 && s.mode == DispatchMode::kLowLatency) {
    s.ll_combined.hook();
    return s.ll_combined.combined_x;
  }
  s.combined.event.wait();
  return s.combined.combined_x;
}

}  // namespace dispatcher

// ---- TokenDispatcher --------------------------------------------------------------------------

TokenDispatcher::TokenDispatcher(BufferCache& cache, const DispatcherOptions& options)
    : state_(std::make_unique<dispatcher::DispatcherState>(cache, *cache.state_, options)) {}

TokenDispatcher::~TokenDispatcher() {
  for (auto& s : state_->slots) state_->release(s);
}

void TokenDispatcher::dispatch_a(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, BatchKind kind,
                                 int micro_batch) {
  auto& st = *state_;
  dispatcher::Slot& s = st.slot(micro_batch, "dispatch_a");
  st.expect_stage(s, micro_batch, dispatcher::Stage::kIdle, "dispatch_a");
  const DispatchMode mode = st.resolve(kind);
  const Generation generation = st.generation();
  const dispatcher::BufferKey key = st.key();
  const provider::Table* table = nullptr;
  const std::string context = fmt::format("[rank {}] dispatcher: dispatch_a", st.shared.group.rank());
  const std::exception_ptr local_error = core::attempt(context, [&] {
    table = dispatcher::provider_for(*st.options.provider_path, generation);
    if (table == nullptr) {
      const ProbeReport& probe = probe_providers(*st.options.provider_path);
      throw InvalidArgument(fmt::format("[rank {}] dispatcher: {} was requested ({}) but is not available from "
                                        "MOE_EP_PROVIDER_PATH = '{}': {}",
                                        st.shared.group.rank(), generation_name(generation),
                                        generation == Generation::kV2 ? "MOE_EP_USE_V2 / DispatcherOptions.use_v2 on"
                                                                      : "MOE_EP_USE_V2 off",
                                        probe.path_list, probe[generation].reason));
    }
    st.validate_dispatch(x, topk_idx, topk_weights, mode);
  });
  const OutputFormat format = mode == DispatchMode::kLowLatency ? OutputFormat::kLowLatency
                              : (generation == Generation::kV2 && *st.options.v2_expanded_normal_layout)
                                  ? OutputFormat::kV2Expanded
                                  : OutputFormat::kNormal;
  const dispatcher::Agreed agreed =
      st.shared.agree("dispatch",
                      {{"micro_batch", micro_batch}, {"mode", static_cast<std::int64_t>(mode)},
                       {"format", static_cast<std::int64_t>(format)}},
                      &key, local_error);
  if (agreed.rebuild) {
    st.shared.rebuild(key, *table);
  } else {
    ++st.shared.stats.reuses;
  }
  s.stage = dispatcher::Stage::kDispatching;
  s.holds = true;
  ++st.shared.holders;
  s.buffer_id = st.shared.buffer_id();
  s.mode = mode;
  s.format = format;
  s.generation = generation;
  s.provider = table->name;
  s.num_tokens = static_cast<int>(x.size(0));
  s.x = x;
  s.topk_idx = topk_idx;
  s.topk_weights = topk_weights;
  try {
    st.start_dispatch(s);
  } catch (...) {
    st.release(s);
    throw;
  }
}

DispatchOutput TokenDispatcher::dispatch_b(int micro_batch) {
  auto& st = *state_;
  dispatcher::Slot& s = st.slot(micro_batch, "dispatch_b");
  st.expect_stage(s, micro_batch, dispatcher::Stage::kDispatching, "dispatch_b");
  try {
    DispatchOutput out = st.finish_dispatch(s, micro_batch);
    s.stage = dispatcher::Stage::kDispatched;
    return out;
  } catch (...) {
    st.release(s);
    throw;
  }
}

void TokenDispatcher::combine_a(const Tensor& expert_output, int micro_batch) {
  auto& st = *state_;
  dispatcher::Slot& s = st.slot(micro_batch, "combine_a");
  st.expect_stage(s, micro_batch, dispatcher::Stage::kDispatched, "combine_a");
  try {
    if (s.buffer_id != st.shared.buffer_id() || !st.shared.key)
      throw StateError(fmt::format("dispatcher: combine_a: the buffer of micro-batch {}'s dispatch was destroyed",
                                   micro_batch));
    const std::exception_ptr local_error =
        core::attempt(fmt::format("[rank {}] dispatcher: combine_a", st.shared.group.rank()),
                      [&] { st.validate_combine(s, expert_output); });
    st.shared.agree("combine", {{"micro_batch", micro_batch}, {"format", static_cast<std::int64_t>(s.format)}}, nullptr,
                    local_error);
    s.stage = dispatcher::Stage::kCombining;
    s.combine_input = expert_output;
    st.start_combine(s);
  } catch (...) {
    st.release(s);  // the handle goes with a failed combine too
    throw;
  }
}

Tensor TokenDispatcher::combine_b(int micro_batch) {
  auto& st = *state_;
  dispatcher::Slot& s = st.slot(micro_batch, "combine_b");
  st.expect_stage(s, micro_batch, dispatcher::Stage::kCombining, "combine_b");
  try {
    Tensor out = st.finish_combine(s);
    st.release(s);
    return out;
  } catch (...) {
    st.release(s);
    throw;
  }
}

DispatchOutput TokenDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                         BatchKind kind, int micro_batch) {
  dispatch_a(x, topk_idx, topk_weights, kind, micro_batch);
  try {
    state_->run_hooks(HookPoint::kAfterDispatchA, micro_batch, state_->slots[micro_batch].mode);
  } catch (...) {
    // The transfer is under way: complete it so peers are not left waiting, then report.
    try {
      dispatch_b(micro_batch);
    } catch (...) {
    }
    state_->release(state_->slots[micro_batch]);
    throw;
  }
  return dispatch_b(micro_batch);
}

Tensor TokenDispatcher::combine(const Tensor& expert_output, int micro_batch) {
  combine_a(expert_output, micro_batch);
  try {
    state_->run_hooks(HookPoint::kAfterCombineA, micro_batch, state_->slots[micro_batch].mode);
  } catch (...) {
    try {
      combine_b(micro_batch);
    } catch (...) {
    }
    throw;
  }
  return combine_b(micro_batch);
}

void TokenDispatcher::add_hook(HookPoint point, std::function<void(const HookInfo&)> hook) {
  if (!hook) throw InvalidArgument("dispatcher: add_hook: the hook is empty");
  state_->hooks.emplace_back(point, std::move(hook));
}

Generation TokenDispatcher::generation() const { return state_->generation(); }
DispatchMode TokenDispatcher::mode() const { return *state_->options.mode; }
DispatchMode TokenDispatcher::resolve(BatchKind kind) const { return state_->resolve(kind); }
const DispatcherOptions& TokenDispatcher::options() const { return state_->options; }

}  // namespace moe_ep
