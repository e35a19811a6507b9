// TokenDispatcher: options and the per-micro-batch stage machine. The four routes (V1 normal,
// V1 low-latency, V2 normal, V2 low-latency) are routes (dispatcher/route.hh), one per batch.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/checks.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "core/timeout.hh"
#include "dispatcher/provider_registry.hh"
#include "dispatcher/route.hh"
#include "dispatcher/state.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/dispatcher.hpp"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"
#include "routing/plan.hh"

namespace moe_ep {

namespace dispatcher {
namespace {

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

// One micro-batch: its stage, the tensors it keeps alive and the route holding its buffer state.
struct Slot {
  Stage stage = Stage::kIdle;
  bool holds = false;  // counted in CacheState::holders
  std::uint64_t buffer_id = 0;
  DispatchMode mode = DispatchMode::kNormal;
  Generation generation = Generation::kV1;
  std::string provider;
  RouteInputs in;
  Tensor combine_input;
  std::unique_ptr<Route> route;  // set from dispatch_a until the slot is released
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
void check_variable_range(bool from_field, const char* field, env::IntVar variable, std::int64_t value) {
  const env::IntRange& range = env::lookup(variable).int_range;
  check_range(origin(from_field, field, variable.name.data()), value, range.min, range.max);
}

// HybridEP's reduction order rounds each other node's sum once (V2's level-2 unit of the hybrid
// path with multiple reduction): across nodes the layout needs both switches on.
void check_hybrid_ep_layout(const DispatcherOptions& in, const DispatcherOptions& o, const Group& group) {
  if (!*o.use_v2 || *o.v2_normal_layout != V2NormalLayout::kHybridEp || group.num_scaleout() == 1) return;
  const std::string layout = origin(in.v2_normal_layout.has_value(), "v2_normal_layout", "MOE_EP_V2_NORMAL_LAYOUT");
  if (!*o.allow_hybrid_mode)
    throw InvalidArgument(fmt::format("dispatcher: {} = hybrid_ep on {} nodes needs allow_hybrid_mode "
                                      "(MOE_EP_V2_ALLOW_HYBRID_MODE) on: HybridEP sums each other node's rows there",
                                      layout, group.num_scaleout()));
  if (!*o.allow_multiple_reduction)
    throw InvalidArgument(fmt::format("dispatcher: {} = hybrid_ep on {} nodes needs allow_multiple_reduction "
                                      "(MOE_EP_V2_ALLOW_MULTIPLE_REDUCTION) on: HybridEP rounds each other node's sum once",
                                      layout, group.num_scaleout()));
}

DispatcherOptions resolve_options(const DispatcherOptions& in, const Group& group) {
  DispatcherOptions o = in;
  o.use_v2 = pick(in.use_v2, env::get(env::kUseV2));
  if (!in.mode) o.mode = parse_mode(env::get(env::kMode), env::kMode.name);
  // The variables' ranges are the limits of these options (checked below for option fields);
  // values read from the environment are in range.
  o.num_max_dispatch_tokens_per_rank = pick(
      in.num_max_dispatch_tokens_per_rank, static_cast<int>(env::get(env::kNumMaxDispatchTokensPerRank)));
  o.num_max_prefill_tokens_per_rank = pick(
      in.num_max_prefill_tokens_per_rank, static_cast<int>(env::get(env::kNumMaxPrefillTokensPerRank)));
  if (!in.dispatch_dtype) o.dispatch_dtype = parse_wire_dtype(env::get(env::kDispatchDtype), env::kDispatchDtype.name);
  o.num_workers = pick(in.num_workers, static_cast<int>(env::get(env::kNumWorkers)));
  o.allow_hybrid_mode = pick(in.allow_hybrid_mode, env::get(env::kV2AllowHybridMode));
  o.allow_multiple_reduction = pick(in.allow_multiple_reduction, env::get(env::kV2AllowMultipleReduction));
  if (!in.v2_normal_layout)
    o.v2_normal_layout = parse_v2_normal_layout(env::get(env::kV2NormalLayout), env::kV2NormalLayout.name);
  o.timeout_secs = in.timeout_secs ? *in.timeout_secs : core::timeout_from_env();
  o.provider_path = pick(in.provider_path, env::get(env::kProviderPath));
  if (!*o.use_v2)
    for (const std::string_view name :
         {env::kV2AllowHybridMode.name, env::kV2AllowMultipleReduction.name, env::kV2NormalLayout.name})
      if (env::current(name).source == env::Source::kEnvironment)
        core::warn(core::Subsys::kEnv, "dispatcher: {} is set but the dispatcher uses V1 (MOE_EP_USE_V2 / "
                   "DispatcherOptions.use_v2 off): ignored", name);

  const int R = group.size();
  check_range("DispatcherOptions.hidden", o.hidden, 1, kMaxHidden);
  check_range("DispatcherOptions.num_topk", o.num_topk, 1, kMaxTopk);
  check_range("DispatcherOptions.num_experts", o.num_experts, 1, kMaxDispatcherExperts);
  if (o.num_experts % R != 0)
    throw InvalidArgument(fmt::format("dispatcher: DispatcherOptions.num_experts = {} is not divisible by the {} ranks",
                                      o.num_experts, R));
  check_variable_range(in.num_max_dispatch_tokens_per_rank.has_value(), "num_max_dispatch_tokens_per_rank",
                       env::kNumMaxDispatchTokensPerRank, *o.num_max_dispatch_tokens_per_rank);
  check_variable_range(in.num_max_prefill_tokens_per_rank.has_value(), "num_max_prefill_tokens_per_rank",
                       env::kNumMaxPrefillTokensPerRank, *o.num_max_prefill_tokens_per_rank);
  check_variable_range(in.num_workers.has_value(), "num_workers", env::kNumWorkers, *o.num_workers);
  check_range("DispatcherOptions.expert_alignment", o.expert_alignment, 1, kMaxDispatcherExpertAlignment);
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
  check_hybrid_ep_layout(in, o, group);
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
      : cache(c), shared(cs), options(resolve_options(o, cs.group)), context{options, shared} {}

  BufferCache& cache;
  CacheState& shared;
  DispatcherOptions options;  // resolved
  RouteContext context;       // what the routes read
  Slot slots[TokenDispatcher::kMicroBatches];
  std::vector<std::pair<HookPoint, std::function<void(const HookInfo&)>>> hooks;
  // Set by dispatch() and combine() for the first half they call: no work between the halves.
  bool at_once = false;
  bool hooked(HookPoint point) const {
    return std::any_of(hooks.begin(), hooks.end(), [&](const auto& h) { return h.first == point; });
  }

  Generation generation() const { return *options.use_v2 ? Generation::kV2 : Generation::kV1; }
  DispatchMode resolve(BatchKind kind) const {
    if (*options.mode != DispatchMode::kAuto) return *options.mode;
    return kind == BatchKind::kPrefill ? DispatchMode::kNormal : DispatchMode::kLowLatency;
  }
  int cap() const { return *options.num_max_dispatch_tokens_per_rank; }
  bool fp8() const { return *options.dispatch_dtype == WireDType::kFP8; }
  int ranks() const { return shared.group.size(); }

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
  DispatchOutput finish_dispatch(Slot& s, int micro_batch);
  void validate_combine(const Slot& s, const Tensor& y) const;
};

// Runs the hooks registered at `point`; returns what one of them threw, as thrown.
std::exception_ptr hooks_failure(DispatcherState& state, HookPoint point, int micro_batch) {
  return core::capture([&] { state.run_hooks(point, micro_batch, state.slots[micro_batch].mode); });
}

// Releases a micro-batch's slot (and its hold on the buffer) when the step that uses it fails;
// the handle goes with a failed step. Steps that end the slot's use release it themselves.
class ReleaseOnFailure {
 public:
  ReleaseOnFailure(DispatcherState& state, Slot& slot)
      : state_(state), slot_(slot), exceptions_(std::uncaught_exceptions()) {}
  ~ReleaseOnFailure() {
    if (std::uncaught_exceptions() > exceptions_) state_.release(slot_);
  }
  ReleaseOnFailure(const ReleaseOnFailure&) = delete;
  ReleaseOnFailure& operator=(const ReleaseOnFailure&) = delete;

 private:
  DispatcherState& state_;
  Slot& slot_;
  int exceptions_;
};

// The dispatcher reads and writes its tensors on the host whatever provider runs its buffer (it
// checks topk_idx, quantizes and packs rows into the buffer's layout): device tensors are refused
// by name, saying so.
static void expect_host(const std::string& ctx, const char* name, const Tensor& t) {
  if (!t.defined() || t.on_host()) return;
  core::fail(ctx, "{} lives on {}: the token dispatcher works on host tensors whatever its provider (it checks "
             "topk_idx and packs rows on the host); pass CPU tensors, or move device tensors with the CUDA "
             "provider's ElasticBuffer directly (moe_ep.deep_ep.ElasticBuffer: docs/python.md)",
             name, device_name(t.device()));
}

void DispatcherState::validate_dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                        DispatchMode mode) const {
  const std::string ctx = fmt::format("[rank {}] dispatcher: dispatch", shared.group.rank());
  for (const auto& [name, t] : {std::pair{"x", &x}, {"topk_idx", &topk_idx}, {"topk_weights", &topk_weights}})
    expect_host(ctx, name, *t);
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

DispatchOutput DispatcherState::finish_dispatch(Slot& s, int micro_batch) {
  DispatchOutput out;
  out.format = s.route->format();
  out.generation = s.generation;
  out.mode = s.mode;
  out.provider = s.provider;
  out.micro_batch = micro_batch;
  s.route->finish_dispatch(s.in, out);
  return out;
}

void DispatcherState::validate_combine(const Slot& s, const Tensor& y) const {
  const std::string ctx =
      fmt::format("[rank {}] dispatcher: combine ({} format)", shared.group.rank(), format_name(s.route->format()));
  expect_host(ctx, "x", y);
  s.route->check_combine_input(ctx, y);
}

}  // namespace dispatcher

// ---- TokenDispatcher --------------------------------------------------------------------------

TokenDispatcher::TokenDispatcher(BufferCache& cache, const DispatcherOptions& options)
    : state_(std::make_unique<dispatcher::DispatcherState>(cache, *cache.state_, options)) {}

TokenDispatcher::~TokenDispatcher() {
  std::lock_guard lock(state_->shared.calls);
  for (auto& s : state_->slots) state_->release(s);
}

void TokenDispatcher::dispatch_a(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, BatchKind kind,
                                 int micro_batch) {
  std::lock_guard lock(state_->shared.calls);
  auto& st = *state_;
  const bool at_once = std::exchange(st.at_once, false);
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
  std::unique_ptr<dispatcher::Route> route = dispatcher::make_route(generation, mode, st.context);
  const OutputFormat format = route->format();
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
  s.generation = generation;
  s.provider = table->name;
  s.in = {.x = x, .topk_idx = topk_idx, .topk_weights = topk_weights, .num_tokens = static_cast<int>(x.size(0)),
          .dispatch_at_once = at_once};
  s.route = std::move(route);
  dispatcher::ReleaseOnFailure release(st, s);
  s.route->start_dispatch(s.in);
}

DispatchOutput TokenDispatcher::dispatch_b(int micro_batch) {
  std::lock_guard lock(state_->shared.calls);
  auto& st = *state_;
  dispatcher::Slot& s = st.slot(micro_batch, "dispatch_b");
  st.expect_stage(s, micro_batch, dispatcher::Stage::kDispatching, "dispatch_b");
  dispatcher::ReleaseOnFailure release(st, s);
  DispatchOutput out = st.finish_dispatch(s, micro_batch);
  s.stage = dispatcher::Stage::kDispatched;
  return out;
}

void TokenDispatcher::combine_a(const Tensor& expert_output, int micro_batch) {
  std::lock_guard lock(state_->shared.calls);
  auto& st = *state_;
  const bool at_once = std::exchange(st.at_once, false);
  dispatcher::Slot& s = st.slot(micro_batch, "combine_a");
  st.expect_stage(s, micro_batch, dispatcher::Stage::kDispatched, "combine_a");
  dispatcher::ReleaseOnFailure release(st, s);
  if (s.buffer_id != st.shared.buffer_id() || !st.shared.key)
    throw StateError(fmt::format("dispatcher: combine_a: the buffer of micro-batch {}'s dispatch was destroyed",
                                 micro_batch));
  const std::exception_ptr local_error =
      core::attempt(fmt::format("[rank {}] dispatcher: combine_a", st.shared.group.rank()),
                    [&] { st.validate_combine(s, expert_output); });
  st.shared.agree("combine", {{"micro_batch", micro_batch}, {"format", static_cast<std::int64_t>(s.route->format())}},
                  nullptr, local_error);
  s.stage = dispatcher::Stage::kCombining;
  s.combine_input = expert_output;
  s.in.combine_at_once = at_once;
  s.route->start_combine(s.in, s.combine_input);
}

Tensor TokenDispatcher::combine_b(int micro_batch) {
  std::lock_guard lock(state_->shared.calls);
  auto& st = *state_;
  dispatcher::Slot& s = st.slot(micro_batch, "combine_b");
  st.expect_stage(s, micro_batch, dispatcher::Stage::kCombining, "combine_b");
  dispatcher::ReleaseOnFailure release(st, s);
  Tensor out = s.route->finish_combine();
  st.release(s);
  return out;
}

DispatchOutput TokenDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                                         BatchKind kind, int micro_batch) {
  std::lock_guard lock(state_->shared.calls);  // the halves and the hooks, as one call
  state_->at_once = !state_->hooked(HookPoint::kAfterDispatchA);
  dispatch_a(x, topk_idx, topk_weights, kind, micro_batch);
  if (const std::exception_ptr error = dispatcher::hooks_failure(*state_, HookPoint::kAfterDispatchA, micro_batch)) {
    // The transfer is under way: complete it so peers are not left waiting (its own failure is
    // second to the hook's), then report.
    core::capture([&] { dispatch_b(micro_batch); });
    state_->release(state_->slots[micro_batch]);
    std::rethrow_exception(error);
  }
  return dispatch_b(micro_batch);
}

Tensor TokenDispatcher::combine(const Tensor& expert_output, int micro_batch) {
  std::lock_guard lock(state_->shared.calls);
  state_->at_once = !state_->hooked(HookPoint::kAfterCombineA);
  combine_a(expert_output, micro_batch);
  if (const std::exception_ptr error = dispatcher::hooks_failure(*state_, HookPoint::kAfterCombineA, micro_batch)) {
    core::capture([&] { combine_b(micro_batch); });
    std::rethrow_exception(error);
  }
  return combine_b(micro_batch);
}

void TokenDispatcher::add_hook(HookPoint point, std::function<void(const HookInfo&)> hook) {
  if (!hook) throw InvalidArgument("dispatcher: add_hook: the hook is empty");
  std::lock_guard lock(state_->shared.calls);
  state_->hooks.emplace_back(point, std::move(hook));
}

Generation TokenDispatcher::generation() const { return state_->generation(); }
DispatchMode TokenDispatcher::mode() const { return *state_->options.mode; }
DispatchMode TokenDispatcher::resolve(BatchKind kind) const { return state_->resolve(kind); }
const DispatcherOptions& TokenDispatcher::options() const { return state_->options; }

}  // namespace moe_ep
