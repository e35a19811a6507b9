// Route: one dispatcher path — V1 normal, V1 low-latency, V2 normal (its layout a parameter: compact,
// expanded or HybridEP's) or V2 low-latency — behind the calls of the stage machine
// (docs/dispatcher.md §4-§6).
//
// A route object is the buffer state of one micro-batch: it is built for the batch's resolved
// generation and mode by make_route (the only place that chooses a path), lives in the slot from
// dispatch_a until the slot is released, and owns every result of its buffer calls (layouts,
// handles, the V2 slab, quantized inputs) so that they stay alive while the transfer needs them.
// The slot calls, in this order and at most once each: start_dispatch (starts the transfer; may
// return before it completes), finish_dispatch (completes it and fills the format's fields of the
// output), then check_combine_input (the expert output the format expects), start_combine and
// finish_combine (returns [N, H] BF16). Dropping a route at any point releases what it holds.
// Routes do no validation and no agreement: the stage machine does both before calling them.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "dispatcher/state.hh"
#include "moe_ep/dispatcher.hpp"

namespace moe_ep::dispatcher {

// What every route reads: the dispatcher's resolved options and its buffer cache.
struct RouteContext {
  const DispatcherOptions& options;  // resolved (every optional set)
  CacheState& shared;

  int ranks() const { return shared.group.size(); }
  int cap() const { return *options.num_max_dispatch_tokens_per_rank; }
  int local_experts() const { return options.num_experts / ranks(); }
  bool fp8() const { return *options.dispatch_dtype == WireDType::kFP8; }
  // NVFP4 is the wire format of low-latency batches only.
  bool nvfp4() const { return *options.dispatch_dtype == WireDType::kNVFP4; }
  // The grouped-GEMM hint of the low-latency format, from the local batch.
  int expected_m(int num_tokens) const {
    const int E = options.num_experts;
    return (num_tokens * ranks() * options.num_topk + E) / E;
  }
};

// The caller's tensors of one micro-batch, kept alive by the slot until its combine finishes.
struct RouteInputs {
  Tensor x, topk_idx, topk_weights;
  int num_tokens = 0;
  // The caller finishes the transfer right after starting it, with nothing in between (dispatch()
  // or combine() with no hook at the point between the halves): a route may complete it when it
  // starts instead of returning a receive to finish later.
  bool dispatch_at_once = false, combine_at_once = false;
};

class Route {
 public:
  virtual ~Route() = default;
  virtual OutputFormat format() const = 0;
  // Quantizes as configured and starts the transfer on the cache's current buffer.
  virtual void start_dispatch(const RouteInputs& in) = 0;
  // Completes the transfer and sets the format's tensors of `out` (its header is set by the caller).
  virtual void finish_dispatch(const RouteInputs& in, DispatchOutput& out) = 0;
  // Refuses an expert output that is not the format's BF16 shape (InvalidArgument naming `context`).
  virtual void check_combine_input(std::string_view context, const Tensor& expert_output) const = 0;
  // Starts the combine of `expert_output` (kept alive by the caller until finish_combine returns).
  virtual void start_combine(const RouteInputs& in, const Tensor& expert_output) = 0;
  virtual Tensor finish_combine() = 0;
};

// The route of one batch: `mode` is the batch's resolved mode (normal or low-latency, never auto).
std::unique_ptr<Route> make_route(Generation generation, DispatchMode mode, const RouteContext& context);

// FP8 E4M3 with per-128 block scales, quantized before sending by every path but V1 low-latency
// (which casts inside the buffer, with the same rule).
void quantize_fp8_input(const RouteContext& context, const Tensor& x, Tensor& data, Tensor& scales);
// The expert output of the row formats (kNormal, kV2Expanded, kHybridEp): BF16 [rows, H], rows contiguous.
void check_row_input(std::string_view context, const RouteContext& c, std::int64_t rows, const Tensor& y);
// The expert output of the low-latency format: BF16 [El, R x cap, H], rows contiguous.
void check_slab_input(std::string_view context, const RouteContext& c, const Tensor& y);

// The rows a normal-mode dispatch of either generation received, as the output's row fields.
template <class Received>
void take_received_rows(const Received& dispatched, DispatchOutput& out) {
  out.hidden_states = dispatched.recv_x;
  out.hidden_states_scale = dispatched.recv_x_scales;
  out.topk_ids = dispatched.recv_topk_idx;
  out.topk_weights = dispatched.recv_topk_weights;
}

// Waits for a combine of any path and returns its [N, H] BF16 rows.
template <class Combined>
Tensor wait_combined(const Combined& combined) {
  combined.event.wait();
  return combined.combined_x;
}

// The four routes (one file each: route_v1_normal.cc, route_v1_low_latency.cc, route_v2_normal.cc,
// route_v2_low_latency.cc); callers go through make_route.
std::unique_ptr<Route> make_v1_normal_route(const RouteContext& context);
std::unique_ptr<Route> make_v1_low_latency_route(const RouteContext& context);
// V2 normal mode in MOE_EP_V2_NORMAL_LAYOUT's layout: compact (kNormal), expanded (kV2Expanded) or
// hybrid_ep (kHybridEp).
std::unique_ptr<Route> make_v2_normal_route(const RouteContext& context, V2NormalLayout layout);
std::unique_ptr<Route> make_v2_low_latency_route(const RouteContext& context);

}  // namespace moe_ep::dispatcher
