// V2 low-latency mode: an expanded dispatch without host wait into the per-expert slab of the
// kLowLatency format, and a combine that weights the slab of expert outputs as it reads it
// (docs/dispatcher.md §5). With the built-in ElasticBuffer the dispatch writes the slab itself
// (expert stride R x cap) and the combine reads the expert outputs in place: one copy of each row
// per direction. Another provider's backend has DeepEP's API only: its groups aligned to R x cap
// are moved into the slab and weighted back into expanded rows (v2_slab.hh). NVFP4 is quantized
// here and travels as bytes: H/2 value bytes and H/64 scale words per row.
#include "dispatcher/provider_registry.hh"
#include "dispatcher/route.hh"
#include "dispatcher/v2_slab.hh"
#include "moe_ep/convert.hpp"

namespace moe_ep::dispatcher {
namespace {

class V2LowLatencyRoute final : public Route {
 public:
  explicit V2LowLatencyRoute(const RouteContext& context) : c_(context) {}

  OutputFormat format() const override { return OutputFormat::kLowLatency; }

  void start_dispatch(const RouteInputs& in) override {
    if (c_.fp8()) quantize_fp8_input(c_, in.x, x_wire_, x_scales_);
    TensorView x = c_.fp8() ? x_wire_.view() : in.x.view();
    if (c_.nvfp4()) {
      // V2 moves bytes: the E2M1 pairs as H/2 one-byte elements, the scale bytes as H/64 words.
      const int H = c_.options.hidden;
      const Nvfp4Tensor q = quantize_nvfp4(in.x, {.global_scale = c_.options.nvfp4_global_scale,
                                                  .use_ue8m0_for_sf = c_.options.nvfp4_use_ue8m0});
      const std::int64_t n = in.x.size(0);
      x_wire_ = q.data.with_view(TensorView(q.data.data(), DType::kFP8E4M3, {n, H / 2}));
      x_scales_ = q.scales.with_view(TensorView(q.scales.data(), DType::kInt32, {n, H / 64}));
      x = x_wire_;
    }
    // No host wait, static shapes: R x cap rows per local expert.
    DispatchArgs a{.x = x,
                   .topk_idx = in.topk_idx,
                   .topk_weights = in.topk_weights,
                   .num_experts = c_.options.num_experts,
                   .num_max_tokens_per_rank = c_.cap(),
                   .expert_alignment = static_cast<int>(rows_per_expert()),
                   .num_sms = *c_.options.num_workers,
                   .async_with_compute_stream = true,
                   .do_cpu_sync = false,
                   .do_expand = true};
    if (c_.fp8() || c_.nvfp4()) a.x_scales = x_scales_;
    buffer_ = builtin_elastic_buffer(c_.shared.elastic());
    if (buffer_) {
      // The slab itself: expert i's rows from row i x R x cap, scales [El, S, R x cap].
      a.expert_alignment = 1;
      a.use_tma_aligned_col_major_sf = true;
      dispatched_ = buffer_->dispatch(a, DispatchExtras{.expert_stride = static_cast<int>(rows_per_expert())});
    } else {
      dispatched_ = c_.shared.elastic()->dispatch(a);  // groups aligned to R x cap, packed
    }
  }

  void finish_dispatch(const RouteInputs& in, DispatchOutput& out) override {
    dispatched_.event.wait();
    slab_ = buffer_ ? slab_views(dispatched_, c_.local_experts(), rows_per_expert())
                    : make_slab(dispatched_, c_.local_experts(), rows_per_expert());
    if (c_.nvfp4()) to_nvfp4_layout(slab_, c_.options.hidden, c_.options.nvfp4_use_ue8m0);
    out.hidden_states = slab_.hidden_states;
    out.hidden_states_scale = slab_.scales;
    out.masked_m = slab_.masked_m;
    out.expected_m = c_.expected_m(in.num_tokens);
  }

  void check_combine_input(std::string_view context, const Tensor& y) const override {
    check_slab_input(context, c_, y);
  }

  void start_combine(const RouteInputs&, const Tensor& expert_output) override {
    CombineArgs a{.handle = dispatched_.handle, .num_sms = *c_.options.num_workers, .async_with_compute_stream = true};
    if (buffer_) {
      // Expanded row i x R x cap + t is slab row (i, t); the combine weights it as it reads it.
      a.x = combine_rows_ = slab_rows(slab_, expert_output);
      combined_ = buffer_->combine(a, CombineExtras{.row_weights = dispatched_.recv_topk_weights});
    } else {
      a.x = combine_rows_ = slab_to_expanded(slab_, dispatched_, expert_output);
      combined_ = c_.shared.elastic()->combine(a);
    }
  }

  Tensor finish_combine() override { return wait_combined(combined_); }

 private:
  std::int64_t rows_per_expert() const { return std::int64_t{c_.ranks()} * c_.cap(); }

  RouteContext c_;
  ElasticBuffer* buffer_ = nullptr;  // the built-in ElasticBuffer behind the backend, or null
  Tensor x_wire_, x_scales_;  // FP8, or NVFP4 bytes viewed as H/2 elements and H/64 scale words
  DispatchResult dispatched_;
  V2Slab slab_;
  Tensor combine_rows_;  // the combine's input rows
  CombineResult combined_;
};

}  // namespace

std::unique_ptr<Route> make_v2_low_latency_route(const RouteContext& context) {
  return std::make_unique<V2LowLatencyRoute>(context);
}

}  // namespace moe_ep::dispatcher
