// The V2 contract: the rules DeepEP V2's ElasticBuffer sets on a call's arguments and the
// arithmetic of what a rank can receive, written once (its configuration's rules and the fields
// the ranks agree on are elastic/v2_config.hh). The built-in provider (src/elastic over src/engine) and the CUDA provider
// (src/cuda) both check through these functions, so they accept and refuse the same calls with the
// same messages; a provider adds only the limits of its own hardware (docs/cuda.md). Every failure
// throws InvalidArgument naming the context ("[rank 3] dispatch"), the argument, its value and the
// limit. Tensors are checked to live on `device` (kDLCPU: any host memory).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "moe_ep/dispatch_types.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::core::v2 {

// num_sms in [0, kMaxWorkers]; a previous_event only with allocate_on_comm_stream (DeepEP's rule).
void check_call(std::string_view context, int num_sms, bool previous_event_without_allocation);

// A dispatch's payload: x (1-, 2- or 4-byte elements, rows contiguous, a row a multiple of
// kRowByteMultiple bytes, hidden in [1, kMaxHidden], at most max_tokens rows when max_tokens > 0,
// the buffer's hidden when fixed_hidden > 0) and x_scales (with float8_e4m3fn x only: float32 or
// int32, [tokens, P >= 1]).
struct Payload {
  DType x_dtype = DType::kUInt8, scale_dtype = DType::kFP32;
  bool fp8 = false;
  int tokens = 0, hidden = 0, scale_columns = 0;
  std::int64_t row_bytes = 0;
};
Payload check_payload(std::string_view context, const TensorView& x, const TensorView& x_scales, int max_tokens,
                      int fixed_hidden, DLDevice device);

// topk_idx of a new dispatch: int64 [tokens, k], rows contiguous. Returns k (checked by check_experts).
int check_topk(std::string_view context, const TensorView& topk_idx, int tokens, DLDevice device);
// k in [1, kMaxTopk]; num_experts positive and a multiple of the ranks; expert_alignment >= 1.
// Returns the experts per rank.
int check_experts(std::string_view context, int num_topk, int num_experts, int num_ranks, int expert_alignment);
// topk_weights: float32 [tokens, k], rows contiguous; cumulative_local_expert_recv_stats: int32
// [local experts], contiguous; do_zero_padding only with do_expand.
void check_options(std::string_view context, const TensorView& topk_weights, const TensorView& stats, int tokens,
                   int num_topk, int local_experts, bool zero_padding, bool expand, DLDevice device);

// The public scalar fields of an EPHandle as its dispatch produced them. A provider keeps them in
// its handle state, writes them into the handle once (write_handle_fields) and compares the
// handle's fields with them whenever the handle comes back (check_handle): handles are read-only.
struct HandleFields {
  bool do_expand = false;
  int num_experts = 0, expert_alignment = 1, num_max_tokens_per_rank = 0, num_tokens = 0, num_topk = 0, hidden = 0;
  std::int64_t num_recv_tokens = 0, num_expanded_tokens = 0;
};
void write_handle_fields(EPHandle& handle, const HandleFields& fields);

// A handle given back to the buffer `this_buffer` (cached dispatch, combine): made by that buffer
// (`made`: the fields its provider state keeps, null when the handle holds no state of this
// provider; `made_by`: the buffer that state belongs to) and its fields unchanged.
void check_handle(std::string_view context, const EPHandle& handle, const HandleFields* made, std::uint64_t made_by,
                  std::uint64_t this_buffer);

// A cached dispatch: what the call gives against what its handle's dispatch fixed. Shape
// arguments left at their defaults (0, false) take the handle's values.
struct CachedCall {
  bool topk_given = false, cpu_sync = false, stats_given = false, expand = false;
  int num_experts = 0, expert_alignment = 0, max_tokens = 0;
};
void check_cached(std::string_view context, const CachedCall& call, const HandleFields& handle, int tokens, int hidden);

// Combine's handle must be given (combine needs the routing of a dispatch).
void check_combine_handle_given(std::string_view context, const EPHandle* handle);

// Combine's inputs against its handle's fields. x: bfloat16 [rows, H], rows contiguous, rows =
// num_recv_tokens (compact) or num_expanded_tokens (expanded); H is x's own width, 1 to
// kMaxHidden (DeepEP V2's handle carries no hidden size: rows dispatched as a byte payload come
// back at the model's width). topk_weights: float32 [rows, k] (compact) or [rows] (expanded),
// rows contiguous. bias: at most 2 bfloat16 [num_tokens, H], rows contiguous.
struct CombineShape {
  std::int64_t rows = 0;
  int hidden = 0;
};
CombineShape check_combine(std::string_view context, const TensorView& x, const TensorView& topk_weights,
                           std::span<const TensorView> bias, const HandleFields& handle, DLDevice device);

// The worst case of a rank's expanded rows: every source's max_tokens tokens, each in
// min(k, local experts) of this rank's experts, each expert's block padded to the alignment.
std::int64_t worst_expanded_rows(int num_ranks, int max_tokens, int num_topk, int local_experts, int expert_alignment);
// Rows are indexed with int32: the worst case (or an expert stride's blocks) must fit.
void check_row_capacity(std::string_view context, int max_tokens, int num_ranks, int num_topk, int local_experts,
                        int expert_alignment, int expert_stride);

}  // namespace moe_ep::core::v2
