#include "reference/low_latency_reference.hh"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "reference/numeric_reference.hh"

namespace moe_ep::reference {

CaseSpec low_latency_spec(int ranks, int scaleout, int experts, int k, int N, int hidden, std::uint64_t seed,
                          double skew) {
  CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.num_experts = experts;
  s.k = k;
  s.max_tokens = N;
  s.hidden = hidden;
  s.seed = seed;
  s.mask_ratio = 0.15;
  s.skew = skew;
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r == 1 ? 0 : std::max(0, N - (r % 3)));
  return s;
}

std::vector<std::pair<int, int>> expert_rows(const CaseSpec& s, const std::vector<RankInputs>& all, int dest, int i) {
  std::vector<std::pair<int, int>> rows;
  const int e = dest * s.experts_per_rank() + i;
  for (int src = 0; src < s.ranks; ++src)
    for (int t = 0; t < all[static_cast<size_t>(src)].num_tokens; ++t)
      for (int j = 0; j < s.k; ++j)
        if (all[static_cast<size_t>(src)].topk[static_cast<size_t>(t * s.k + j)] == e) rows.push_back({src, t});
  return rows;
}

void check_slab(const CaseSpec& s, const SlabFormat& f, const std::vector<RankInputs>& all, int me,
                const TensorView& recv_x, const TensorView& sc, const TensorView& counts,
                std::vector<std::string>& bad) {
  const int El = s.experts_per_rank(), H = s.hidden;
  const std::int64_t slab_rows = f.rows_per_expert;
  if (recv_x.ndim() != 3 || recv_x.size(0) != El || recv_x.size(1) != slab_rows || recv_x.size(2) != H) {
    bad.push_back(fmt::format("slab has shape {}, expected [{}, {}, {}]", recv_x.describe(), El, slab_rows, H));
    return;
  }
  for (int i = 0; i < El; ++i) {
    const auto rows = expert_rows(s, all, me, i);
    if (counts.data_as<std::int32_t>()[i] != static_cast<int>(rows.size()))
      bad.push_back(fmt::format("count[{}] = {}, expected {}", i, counts.data_as<std::int32_t>()[i], rows.size()));
    for (std::size_t row = 0; row < rows.size(); ++row) {
      const auto [src, t] = rows[row];
      const std::int64_t slab_row = i * slab_rows + static_cast<std::int64_t>(row);
      const auto* x = reinterpret_cast<const std::uint16_t*>(all[static_cast<size_t>(src)].x.data()) + t * H;
      if (!f.fp8) {
        if (std::memcmp(recv_x.data_as<std::uint16_t>() + slab_row * H, x, sizeof(std::uint16_t) * static_cast<size_t>(H)) != 0)
          bad.push_back(fmt::format("slab[{}, {}] is not rank {} token {}", i, row, src, t));
        continue;
      }
      // FP8: the per-128 cast of the source row, by the reference quantizer (numeric_reference.hh).
      const Fp8Row q = quantize_row_fp8(x, H, f.round_scale, f.ue8m0);
      const std::uint8_t* got_codes = recv_x.data_as<std::uint8_t>() + slab_row * H;
      for (int h = 0; h < H; ++h)
        if (got_codes[h] != q.codes[static_cast<size_t>(h)]) {
          bad.push_back(fmt::format("FP8 slab[{}, {}] differs from the cast of rank {} token {} first at {}: {:#04x}, "
                                    "expected {:#04x}", i, row, src, t, h, got_codes[h], q.codes[static_cast<size_t>(h)]));
          break;
        }
      if (sc.stride(1) != 1) bad.push_back("slab scales must have token stride 1");
      if (sc.size(2) != static_cast<std::int64_t>(q.scales.size()))
        bad.push_back(fmt::format("slab scales have {} columns, expected {}", sc.size(2), q.scales.size()));
      for (std::int64_t p = 0; p < sc.size(2) && p < static_cast<std::int64_t>(q.scales.size()); ++p) {
        const std::uint32_t got = sc.data_as<std::uint32_t>()[i * sc.stride(0) + static_cast<std::int64_t>(row) * sc.stride(1) + p * sc.stride(2)];
        if (got != q.scales[static_cast<size_t>(p)])
          bad.push_back(fmt::format("scales[{}, {}, {}] = {:#010x}, expected {:#010x}", i, row, p, got, q.scales[static_cast<size_t>(p)]));
      }
    }
  }
}

Tensor slab_expert_outputs(const CaseSpec& s, const std::vector<RankInputs>& all, int me, std::int64_t rows_per_expert) {
  const int El = s.experts_per_rank(), H = s.hidden;
  Tensor y = Tensor::zeros({El, rows_per_expert, H}, DType::kBF16);
  for (int i = 0; i < El; ++i) {
    const auto rows = expert_rows(s, all, me, i);
    for (std::size_t row = 0; row < rows.size(); ++row)
      for (int h = 0; h < H; ++h)
        y.data_as<std::uint16_t>()[(i * rows_per_expert + static_cast<std::int64_t>(row)) * H + h] =
            s.value(me, i, rows[row].first * s.max_tokens + rows[row].second, h);
  }
  return y;
}

std::vector<std::uint16_t> low_latency_combine_reference(const CaseSpec& s, const RankInputs& in, int me) {
  const int H = s.hidden, k = s.k, El = s.experts_per_rank();
  std::vector<std::uint16_t> out(static_cast<size_t>(in.num_tokens) * H);
  for (int t = 0; t < in.num_tokens; ++t)
    for (int h = 0; h < H; ++h) {
      float acc = 0.0f;
      bool first = true;
      for (int j = 0; j < k; ++j) {
        const auto id = in.topk[static_cast<size_t>(t * k + j)];
        if (id < 0) continue;
        const float product = in.weights[static_cast<size_t>(t * k + j)] *
                              float_from_bf16(s.value(static_cast<int>(id / El), static_cast<int>(id % El), me * s.max_tokens + t, h));
        acc = first ? product : acc + product;
        first = false;
      }
      out[static_cast<size_t>(t * H + h)] = bf16_from_float(acc);
    }
  return out;
}

}  // namespace moe_ep::reference
