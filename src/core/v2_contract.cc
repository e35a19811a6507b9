#include "core/v2_contract.hh"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "core/arith.hh"
#include "core/checks.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::core::v2 {

void check_call(std::string_view ctx, int num_sms, bool previous_event_without_allocation) {
  if (num_sms < 0 || num_sms > kMaxWorkers) fail(ctx, "num_sms = {} is outside [0, {}]", num_sms, kMaxWorkers);
  if (previous_event_without_allocation)
    fail(ctx, "previous_event requires allocate_on_comm_stream = true (DeepEP's rule)");
}

Payload check_payload(std::string_view ctx, const TensorView& x, const TensorView& x_scales, int max_tokens,
                      int fixed_hidden, DLDevice device) {
  Payload p;
  if (!x.defined()) fail(ctx, "x is missing");
  p.x_dtype = x.dtype();
  p.fp8 = p.x_dtype == DType::kFP8E4M3;
  // Rows travel as bytes: any 1-, 2- or 4-byte element type (bool is not a payload).
  const std::size_t size = element_size(p.x_dtype);
  if (p.x_dtype == DType::kBool || (size != 1 && size != 2 && size != 4))
    fail(ctx, "x has dtype {}; the payload must have 1-, 2- or 4-byte elements (bfloat16, float16, float32, int8, "
         "int16, int32, uint8, or float8_e4m3fn with x_scales)", dtype_name(p.x_dtype));
  expect_tensor(ctx, "x", x, p.x_dtype, {-1, -1}, device);
  expect_rows_contiguous(ctx, "x", x);
  p.tokens = int_size(ctx, "x", x, 0);
  p.hidden = int_size(ctx, "x", x, 1);
  if (max_tokens > 0 && p.tokens > max_tokens)
    fail(ctx, "x has {} tokens, more than num_max_tokens_per_rank = {}", p.tokens, max_tokens);
  if (fixed_hidden > 0 && p.hidden != fixed_hidden)
    fail(ctx, "x has hidden size {}, the buffer was built for hidden = {}", p.hidden, fixed_hidden);
  if (p.hidden <= 0 || p.hidden > kMaxHidden) fail(ctx, "x has hidden size {}, expected 1 to {}", p.hidden, kMaxHidden);
  p.row_bytes = std::int64_t{p.hidden} * static_cast<std::int64_t>(size);
  if (p.row_bytes % kRowByteMultiple != 0)
    fail(ctx, "x is {} [{}, {}]: a row is {} bytes, which must be a multiple of {} (hidden x element size, here hidden "
         "must be a multiple of {})", dtype_name(p.x_dtype), p.tokens, p.hidden, p.row_bytes, kRowByteMultiple,
         kRowByteMultiple / static_cast<std::int64_t>(size));
  if (p.fp8) {
    if (!x_scales.defined()) fail(ctx, "x is float8_e4m3fn but x_scales is missing");
    p.scale_dtype = x_scales.dtype();
    if (p.scale_dtype != DType::kFP32 && p.scale_dtype != DType::kInt32)
      fail(ctx, "x_scales has dtype {}, expected float32 or int32 (packed UE8M0)", dtype_name(p.scale_dtype));
    expect_tensor(ctx, "x_scales", x_scales, p.scale_dtype, {p.tokens, -1}, device);
    p.scale_columns = int_size(ctx, "x_scales", x_scales, 1);
    if (p.scale_columns <= 0) fail(ctx, "x_scales has {} columns, expected at least 1", p.scale_columns);
  } else if (x_scales.defined()) {
    fail(ctx, "x_scales is given but x is {} (scales go with float8_e4m3fn x only)", dtype_name(p.x_dtype));
  }
  return p;
}

int check_topk(std::string_view ctx, const TensorView& topk_idx, int tokens, DLDevice device) {
  if (!topk_idx.defined()) fail(ctx, "topk_idx is missing (required without a handle)");
  expect_tensor(ctx, "topk_idx", topk_idx, DType::kInt64, {tokens, -1}, device);
  expect_rows_contiguous(ctx, "topk_idx", topk_idx);
  return int_size(ctx, "topk_idx", topk_idx, 1);
}

int check_experts(std::string_view ctx, int k, int E, int R, int alignment) {
  if (k < 1 || k > kMaxTopk) fail(ctx, "topk_idx has {} columns (k), expected 1 to {}", k, kMaxTopk);
  if (E <= 0) fail(ctx, "num_experts = {} must be positive", E);
  if (E % R != 0) fail(ctx, "num_experts = {} is not divisible by the {} ranks", E, R);
  if (alignment < 1) fail(ctx, "expert_alignment = {} must be at least 1", alignment);
  return E / R;
}

void check_options(std::string_view ctx, const TensorView& w, const TensorView& stats, int tokens, int k, int El,
                   bool zero_padding, bool expand, DLDevice device) {
  if (w.defined()) {
    expect_tensor(ctx, "topk_weights", w, DType::kFP32, {tokens, k}, device);
    expect_rows_contiguous(ctx, "topk_weights", w);
  }
  if (stats.defined()) {
    expect_tensor(ctx, "cumulative_local_expert_recv_stats", stats, DType::kInt32, {El}, device);
    expect_contiguous(ctx, "cumulative_local_expert_recv_stats", stats);
  }
  if (zero_padding && !expand) fail(ctx, "do_zero_padding = true requires do_expand = true");
}

void write_handle_fields(EPHandle& h, const HandleFields& f) {
  h.do_expand = f.do_expand;
  h.num_experts = f.num_experts;
  h.expert_alignment = f.expert_alignment;
  h.num_max_tokens_per_rank = f.num_max_tokens_per_rank;
  h.num_tokens = f.num_tokens;
  h.num_topk = f.num_topk;
  h.hidden = f.hidden;
  h.num_recv_tokens = f.num_recv_tokens;
  h.num_expanded_tokens = f.num_expanded_tokens;
}

void check_handle(std::string_view ctx, const EPHandle& h, const HandleFields* made, std::uint64_t made_by,
                  std::uint64_t here) {
  if (!made || made_by != here)
    fail(ctx, "handle was created by another buffer (buffer id {}, this buffer {})", made ? made_by : 0, here);
  const HandleFields& f = *made;
  auto same = [&](const char* field, auto value, auto dispatched) {
    if (value != dispatched)
      fail(ctx, "handle.{} = {} differs from the {} its dispatch produced (handles are read-only)", field, value,
           dispatched);
  };
  same("do_expand", h.do_expand, f.do_expand);
  same("num_experts", h.num_experts, f.num_experts);
  same("expert_alignment", h.expert_alignment, f.expert_alignment);
  same("num_max_tokens_per_rank", h.num_max_tokens_per_rank, f.num_max_tokens_per_rank);
  same("num_tokens", h.num_tokens, f.num_tokens);
  same("num_topk", h.num_topk, f.num_topk);
  same("hidden", h.hidden, f.hidden);
  same("num_recv_tokens", h.num_recv_tokens, f.num_recv_tokens);
  same("num_expanded_tokens", h.num_expanded_tokens, f.num_expanded_tokens);
}

void check_cached(std::string_view ctx, const CachedCall& a, const HandleFields& h, int tokens, int hidden) {
  if (a.topk_given) fail(ctx, "topk_idx must not be given with a cached handle");
  if (a.cpu_sync) fail(ctx, "do_cpu_sync = true is not allowed with a cached handle");
  if (a.stats_given) fail(ctx, "cumulative_local_expert_recv_stats is not allowed with a cached handle");
  if (a.num_experts != 0 && a.num_experts != h.num_experts)
    fail(ctx, "num_experts = {} differs from the handle's {}", a.num_experts, h.num_experts);
  if (a.expert_alignment != 0 && a.expert_alignment != h.expert_alignment)
    fail(ctx, "expert_alignment = {} differs from the handle's {}", a.expert_alignment, h.expert_alignment);
  if (a.max_tokens != 0 && a.max_tokens != h.num_max_tokens_per_rank)
    fail(ctx, "num_max_tokens_per_rank = {} differs from the handle's {}", a.max_tokens, h.num_max_tokens_per_rank);
  if (a.expand && !h.do_expand) fail(ctx, "do_expand = true differs from the handle's false");
  if (tokens != h.num_tokens) fail(ctx, "x has {} tokens, the handle was made for {}", tokens, h.num_tokens);
  if (hidden != h.hidden) fail(ctx, "x has hidden size {}, the handle was made for {}", hidden, h.hidden);
}

void check_combine_handle_given(std::string_view ctx, const EPHandle* handle) {
  if (!handle) fail(ctx, "handle is missing (combine needs the handle of a dispatch)");
}

CombineShape check_combine(std::string_view ctx, const TensorView& x, const TensorView& w,
                           std::span<const TensorView> bias, const HandleFields& h, DLDevice device) {
  CombineShape s;
  s.rows = h.do_expand ? h.num_expanded_tokens : h.num_recv_tokens;
  if (!x.defined()) fail(ctx, "x is missing");
  expect_device(ctx, "x", x, device);
  if (x.dtype() != DType::kBF16)
    fail(ctx, "x has dtype {} ({}); combine reduces bfloat16 rows only: pass the expert outputs as bfloat16 "
         "(dispatch moves any payload dtype, combine does not)", dtype_name(x.dtype()), x.describe());
  expect_tensor(ctx, "x", x, DType::kBF16, {-1, -1}, device);
  expect_rows_contiguous(ctx, "x", x);
  if (x.size(0) != s.rows)
    fail(ctx, "x has {} rows, the handle's {} layout has {}", x.size(0), h.do_expand ? "expanded" : "compact", s.rows);
  if (x.size(1) <= 0 || x.size(1) > kMaxHidden) fail(ctx, "x has hidden size {}, expected 1 to {}", x.size(1), kMaxHidden);
  s.hidden = static_cast<int>(x.size(1));
  if (w.defined()) {
    if (h.do_expand) {
      expect_tensor(ctx, "topk_weights", w, DType::kFP32, {s.rows}, device);
    } else {
      expect_tensor(ctx, "topk_weights", w, DType::kFP32, {s.rows, h.num_topk}, device);
    }
    expect_rows_contiguous(ctx, "topk_weights", w);
  }
  if (bias.size() > 2) fail(ctx, "{} bias tensors given, at most 2 are accepted", bias.size());
  for (std::size_t b = 0; b < bias.size(); ++b) {
    const std::string name = fmt::format("bias[{}]", b);
    expect_tensor(ctx, name, bias[b], DType::kBF16, {h.num_tokens, s.hidden}, device);
    expect_rows_contiguous(ctx, name, bias[b]);
  }
  return s;
}

std::int64_t worst_expanded_rows(int R, int T, int k, int El, int A) {
  const std::int64_t rows = std::int64_t{R} * T * std::min(k, El) + std::int64_t{A - 1} * El;
  return round_up<std::int64_t>(rows, A);
}

void check_row_capacity(std::string_view ctx, int T, int R, int k, int El, int A, int stride) {
  const std::int64_t worst =
      std::max(std::int64_t{T} * R * std::min(k, El) + std::int64_t{A} * El, std::int64_t{stride} * El);
  if (worst > (std::int64_t{1} << 31) - 1)
    fail(ctx, "num_max_tokens_per_rank = {} x {} ranks x min(k, local experts) = {} rows exceed the int32 row index", T,
         R, worst);
}

}  // namespace moe_ep::core::v2
