#include "dispatcher/v2_slab.hh"

#include <fmt/format.h>

#include <cstring>

#include "core/arith.hh"
#include "core/host_allocator.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::dispatcher {

V2Slab slab_views(const DispatchResult& r, int local_experts, std::int64_t rows_per_expert) {
  V2Slab s;
  s.rows_per_expert = rows_per_expert;
  s.masked_m = Tensor::empty({local_experts}, DType::kInt32);
  const auto* unaligned = r.handle->num_unaligned_recv_tokens_per_expert.data_as<const std::int32_t>();
  for (int i = 0; i < local_experts; ++i) {
    s.counts.push_back(unaligned[i]);
    s.masked_m.data_as<std::int32_t>()[i] = unaligned[i];
  }
  const std::int64_t H = r.recv_x.size(1);
  if (r.recv_x.size(0) != local_experts * rows_per_expert)
    throw StateError(fmt::format("dispatcher: V2 low-latency: the dispatch returned {} rows, expected {} x {}",
                                 r.recv_x.size(0), local_experts, rows_per_expert));
  s.hidden_states =
      r.recv_x.with_view(TensorView(r.recv_x.data(), r.recv_x.dtype(), {local_experts, rows_per_expert, H}));
  s.scales = r.recv_x_scales;  // [local_experts, rows_per_expert, S], token stride 1 (or undefined)
  return s;
}

Tensor slab_rows(const V2Slab& s, const Tensor& y) {
  const std::int64_t local_experts = y.size(0), rows_per_expert = y.size(1), H = y.size(2);
  if (y.stride(0) == rows_per_expert * y.stride(1)) {
    const std::int64_t shape[] = {local_experts * rows_per_expert, H}, strides[] = {y.stride(1), 1};
    return y.with_view(TensorView(y.data(), DType::kBF16, shape, strides));
  }
  Tensor rows = Tensor::empty({local_experts * rows_per_expert, H}, DType::kBF16);
  for (std::int64_t i = 0; i < local_experts; ++i)
    for (std::int64_t t = 0; t < s.counts[static_cast<size_t>(i)]; ++t)
      std::memcpy(rows.data_as<std::uint16_t>() + (i * rows_per_expert + t) * H,
                  y.data_as<const std::uint16_t>() + i * y.stride(0) + t * y.stride(1), sizeof(std::uint16_t) * H);
  return rows;
}

V2Slab make_slab(const DispatchResult& r, int local_experts, std::int64_t rows_per_expert) {
  const EPHandle& h = *r.handle;
  V2Slab s;
  s.rows_per_expert = rows_per_expert;
  s.masked_m = Tensor::empty({local_experts}, DType::kInt32);
  const auto* unaligned = h.num_unaligned_recv_tokens_per_expert.data_as<const std::int32_t>();
  const auto* psum = h.psum_num_recv_tokens_per_expert.data_as<const std::int32_t>();
  for (int i = 0; i < local_experts; ++i) {
    const std::int32_t count = unaligned[i];
    const std::int64_t start = psum[i] - count;
    // Expert groups are aligned to rows_per_expert rows and hold at most that many; each starts at or
    // before its slab position.
    if (count < 0 || count > rows_per_expert || start < 0 || start % rows_per_expert != 0 ||
        start > i * rows_per_expert)
      throw StateError(fmt::format("dispatcher: V2 low-latency: expert {} has {} rows at row {}, not an aligned group "
                                   "of at most {} rows",
                                   i, count, start, rows_per_expert));
    s.counts.push_back(count);
    s.starts.push_back(start);
    s.masked_m.data_as<std::int32_t>()[i] = count;
  }
  const std::int64_t H = r.recv_x.size(1);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * element_size(r.recv_x.dtype());
  if (r.recv_x.size(0) >= local_experts * rows_per_expert) {
    // Last expert first: a group moves to a higher or equal position, never onto a group still to move.
    auto* base = static_cast<std::byte*>(r.recv_x.data());
    for (int i = local_experts - 1; i >= 0; --i) {
      const std::int64_t start = s.starts[static_cast<size_t>(i)];
      if (start != i * rows_per_expert && s.counts[static_cast<size_t>(i)] > 0)
        std::memcpy(base + i * rows_per_expert * row_bytes, base + start * row_bytes,
                    s.counts[static_cast<size_t>(i)] * row_bytes);
    }
    s.hidden_states =
        r.recv_x.with_view(TensorView(r.recv_x.data(), r.recv_x.dtype(), {local_experts, rows_per_expert, H}));
  } else {
    s.hidden_states = Tensor::empty({local_experts, rows_per_expert, H}, r.recv_x.dtype());
    const auto* from = static_cast<const std::byte*>(r.recv_x.data());
    auto* to = static_cast<std::byte*>(s.hidden_states.data());
    for (int i = 0; i < local_experts; ++i)
      std::memcpy(to + i * rows_per_expert * row_bytes, from + s.starts[static_cast<size_t>(i)] * row_bytes,
                  s.counts[static_cast<size_t>(i)] * row_bytes);
  }
  if (r.recv_x_scales.defined()) {
    // Scales are 4-byte words (FP32, or four UE8M0 exponents): storage [local_experts, S,
    // rows_per_expert], viewed [local_experts, rows_per_expert, S].
    const std::int64_t S = r.recv_x_scales.size(1);
    Tensor storage = Tensor::empty({local_experts, S, rows_per_expert}, r.recv_x_scales.dtype());
    const auto* src = r.recv_x_scales.data_as<const std::uint32_t>();
    auto* dst = storage.data_as<std::uint32_t>();
    const std::int64_t row_stride = r.recv_x_scales.stride(0), col_stride = r.recv_x_scales.stride(1);
    for (int i = 0; i < local_experts; ++i)
      for (std::int64_t p = 0; p < S; ++p)
        for (std::int64_t t = 0; t < s.counts[static_cast<size_t>(i)]; ++t)
          dst[(i * S + p) * rows_per_expert + t] =
              src[(s.starts[static_cast<size_t>(i)] + t) * row_stride + p * col_stride];
    s.scales = storage.with_view(storage.transposed(1, 2));
  }
  return s;
}

void to_nvfp4_layout(V2Slab& s, int hidden, bool ue8m0) {
  const std::int64_t local_experts = static_cast<std::int64_t>(s.counts.size()), rows_per_expert = s.rows_per_expert;
  const std::int64_t H = hidden;
  const std::int64_t rm = core::ceil_div(rows_per_expert, 128), rk = H / 64, words = H / 64;
  Tensor& x = s.hidden_states;  // [local_experts, rows_per_expert, H/2] one-byte elements, contiguous
  const std::int64_t xs[] = {rows_per_expert, H / 2, local_experts}, xt[] = {H / 2, 1, rows_per_expert * (H / 2)};
  x = x.with_view(TensorView(x.data(), DType::kUInt8, xs, xt));
  const DType dtype = ue8m0 ? DType::kInt32 : DType::kFP8E4M3;
  Tensor sf = Tensor::empty({local_experts, rm, rk, 32, 4, 4}, dtype);
  core::zero_host_sparse(sf.data(), static_cast<std::size_t>(sf.nbytes()));  // mostly untouched tiles
  const std::int64_t per = rm * rk * 512, expert_bytes = per * static_cast<std::int64_t>(element_size(dtype));
  // Scale words of row t of expert i: storage [local_experts, H/64, rows_per_expert] (the FP8 slab's
  // token-stride-1 layout).
  const auto* words_of = s.scales.data_as<const std::uint32_t>();
  auto* out = static_cast<std::uint8_t*>(sf.data());
  for (std::int64_t i = 0; i < local_experts; ++i)
    for (std::int64_t t = 0; t < s.counts[static_cast<size_t>(i)]; ++t)
      for (std::int64_t j = 0; j < H / 16; ++j) {
        const std::uint32_t w = words_of[(i * words + j / 4) * rows_per_expert + t];
        out[i * expert_bytes + ((t / 128) * rk + j / 4) * 512 + (t % 32) * 16 + ((t % 128) / 32) * 4 + j % 4] =
            static_cast<std::uint8_t>(w >> (8 * (j % 4)));
      }
  const std::int64_t ss[] = {32, 4, rm, 4, rk, local_experts}, st[] = {16, 4, rk * 512, 1, 512, per};
  s.scales = sf.with_view(TensorView(sf.data(), dtype, ss, st));
}

Tensor slab_to_expanded(const V2Slab& s, const DispatchResult& r, const TensorView& y) {
  const std::int64_t H = y.size(2);
  Tensor x = Tensor::empty({r.handle->num_expanded_tokens, H}, DType::kBF16);
  const auto* w = r.recv_topk_weights.data_as<const float>();
  auto* out = x.data_as<std::uint16_t>();
  for (std::size_t i = 0; i < s.counts.size(); ++i)
    for (std::int64_t t = 0; t < s.counts[i]; ++t) {
      const std::int64_t row = s.starts[i] + t;
      const float weight = w[row];
      const auto* in = y.data_as<const std::uint16_t>() + static_cast<std::int64_t>(i) * y.stride(0) + t * y.stride(1);
      std::uint16_t* o = out + row * H;
      for (std::int64_t h = 0; h < H; ++h) o[h] = float_to_bf16(weight * bf16_to_float(in[h]));
    }
  return x;
}

}  // namespace moe_ep::dispatcher
