#include "support/elastic_harness.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <random>

#include "reference/numeric_reference.hh"

namespace moe_ep::testing {
namespace {

using reference::CaseSpec;
using reference::RankInputs;

constexpr float kWeightScale = 2.0f;
constexpr std::uint16_t kPoison = 0x7fc1;  // a NaN: rows that must never be read

class Mismatches {
 public:
  explicit Mismatches(int rank) : rank_(rank) {}
  template <class... Args>
  void add(fmt::format_string<Args...> f, Args&&... args) {
    if (list_.size() < 20)
      list_.push_back(fmt::format("[rank {}] {}", rank_, context_) + fmt::format(f, std::forward<Args>(args)...));
  }
  std::vector<std::string>& list() { return list_; }
  void set_context(std::string context) { context_ = std::move(context); }

 private:
  int rank_;
  std::string context_;
  std::vector<std::string> list_;
};

bool same_bytes(const void* a, const void* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

std::uint32_t scale_at(const TensorView& t, std::int64_t row, int col) {
  return t.data_as<const std::uint32_t>()[row * t.stride(0) + col * t.stride(1)];
}

// The handle's counts: per scale-up rank, per expert (aligned and not), num_recv_tokens.
void verify_counts(const CaseSpec& spec, const RunOptions& opt, const std::vector<RankInputs>& all,
                   const reference::RefDispatch& ref, const DispatchResult& res, int me, Mismatches& bad) {
  const int El = spec.experts_per_rank();
  const EPHandle& h = *res.handle;
  const auto real = static_cast<std::int64_t>(ref.rows.size());
  const std::int64_t worst = std::int64_t{spec.max_tokens} * spec.ranks;
  const std::int32_t* psum_su = h.psum_num_recv_tokens_per_scaleup_rank.data_as<const std::int32_t>();
  const int su = static_cast<int>(h.psum_num_recv_tokens_per_scaleup_rank.size(0));
  if (psum_su[su - 1] != real) bad.add("psum per scale-up rank ends at {}, expected {} rows", psum_su[su - 1], real);
  for (int r = 0; r < su; ++r) {
    int expected = 0;
    for (int s = 0; s < spec.ranks; ++s)
      if (s % su <= r) expected += ref.per_source[static_cast<size_t>(s)];
    if (psum_su[r] != expected) bad.add("psum_num_recv_tokens_per_scaleup_rank[{}] = {}, expected {}", r, psum_su[r], expected);
  }
  if (h.num_recv_tokens != (opt.cpu_sync ? real : worst))
    bad.add("num_recv_tokens = {}, expected {}", h.num_recv_tokens, opt.cpu_sync ? real : worst);
  std::vector<int> aligned;
  for (int i = 0; i < El; ++i) {
    const int u = ref.unaligned[static_cast<size_t>(i)];
    aligned.push_back((u + spec.alignment - 1) / spec.alignment * spec.alignment);
    if (h.num_unaligned_recv_tokens_per_expert.data_as<const std::int32_t>()[i] != u)
      bad.add("num_unaligned_recv_tokens_per_expert[{}] wrong", i);
    const int psum = h.psum_num_recv_tokens_per_expert.data_as<const std::int32_t>()[i];
    const int expected = spec.expand ? ref.start[static_cast<size_t>(i)] + u : ref.start[static_cast<size_t>(i)] + aligned.back();
    if (psum != expected) bad.add("psum_num_recv_tokens_per_expert[{}] = {}, expected {}", i, psum, expected);
  }
  if (opt.cpu_sync ? h.num_recv_tokens_per_expert_list != aligned : !h.num_recv_tokens_per_expert_list.empty())
    bad.add("num_recv_tokens_per_expert_list = [{}], expected [{}]", fmt::join(h.num_recv_tokens_per_expert_list, ","),
            fmt::join(aligned, ","));
}

// The metadata of every received row and, in the compact layout, its bytes, scales, ids and weights.
void verify_received_rows(const CaseSpec& spec, const RunOptions& opt, const std::vector<RankInputs>& all,
                          const reference::RefDispatch& ref, const DispatchResult& res, int me, Mismatches& bad) {
  const int k = spec.k, rb = spec.row_bytes();
  const EPHandle& h = *res.handle;
  const auto real = static_cast<std::int64_t>(ref.rows.size());
  // Metadata and compact rows.
  const auto* meta = h.recv_src_metadata.data_as<const std::int32_t>();
  for (std::int64_t i = 0; i < real; ++i) {
    const auto& row = ref.rows[static_cast<size_t>(i)];
    const RankInputs& src = all[static_cast<size_t>(row.source)];
    const std::int32_t* m = meta + i * (k + 2);
    if (m[0] != row.source * spec.max_tokens + row.token || m[1] != row.source * k + row.master_lane)
      bad.add("recv_src_metadata[{}] = ({}, {}), expected ({}, {})", i, m[0], m[1], row.source * spec.max_tokens + row.token,
              row.source * k + row.master_lane);
    for (int j = 0; j < k; ++j) {
      const int expected = spec.expand ? row.expanded_rows[static_cast<size_t>(j)] : -1;
      if (m[2 + j] != expected) bad.add("recv_src_metadata[{}, {}] = {}, expected {}", i, 2 + j, m[2 + j], expected);
    }
    if (spec.expand) continue;
    if (!same_bytes(static_cast<const std::uint8_t*>(res.recv_x.data()) + i * rb, &src.x[static_cast<size_t>(row.token) * rb],
                    static_cast<size_t>(rb)))
      bad.add("recv_x row {} differs from rank {} token {}", i, row.source, row.token);
    for (int p = 0; p < spec.scale_cols && spec.fp8; ++p)
      if (scale_at(res.recv_x_scales, i, p) != src.scales[static_cast<size_t>(row.token * spec.scale_cols + p)])
        bad.add("recv_x_scales[{}, {}] wrong", i, p);
    for (int j = 0; j < k; ++j) {
      if (res.recv_topk_idx.data_as<const std::int64_t>()[i * k + j] != row.local_ids[static_cast<size_t>(j)])
        bad.add("recv_topk_idx[{}, {}] = {}, expected {}", i, j, res.recv_topk_idx.data_as<const std::int64_t>()[i * k + j],
                row.local_ids[static_cast<size_t>(j)]);
      if (spec.weights &&
          res.recv_topk_weights.data_as<const float>()[i * k + j] != src.weights[static_cast<size_t>(row.token * k + j)])
        bad.add("recv_topk_weights[{}, {}] wrong", i, j);
    }
  }
}

// The rows beyond the real ones (compact), or the expanded layout's rows and padding.
void verify_layout_rows(const CaseSpec& spec, const RunOptions& opt, const std::vector<RankInputs>& all,
                        const reference::RefDispatch& ref, const DispatchResult& res, int me, Mismatches& bad) {
  const int k = spec.k, El = spec.experts_per_rank(), rb = spec.row_bytes();
  const auto real = static_cast<std::int64_t>(ref.rows.size());
  const std::int64_t worst = std::int64_t{spec.max_tokens} * spec.ranks;
  if (!spec.expand) {
    if (res.recv_x.size(0) != (opt.cpu_sync ? real : worst)) bad.add("recv_x has {} rows", res.recv_x.size(0));
    for (std::int64_t i = real; i < res.recv_topk_idx.size(0); ++i)
      for (int j = 0; j < k; ++j)
        if (res.recv_topk_idx.data_as<const std::int64_t>()[i * k + j] != -1) bad.add("tail recv_topk_idx[{}] not -1", i);
  } else {
    if (res.recv_topk_idx.defined()) bad.add("recv_topk_idx must be undefined with do_expand");
    const std::int64_t worst_exp = (std::int64_t{spec.ranks} * spec.max_tokens * std::min(k, El) +
                                    std::int64_t{spec.alignment - 1} * El + spec.alignment - 1) / spec.alignment * spec.alignment;
    if (res.recv_x.size(0) != (opt.cpu_sync ? ref.expanded_rows : worst_exp))
      bad.add("expanded recv_x has {} rows, expected {}", res.recv_x.size(0), opt.cpu_sync ? ref.expanded_rows : worst_exp);
    for (int r = 0; r < ref.expanded_rows; ++r) {
      const auto [owner, lane] = ref.expanded_owner[static_cast<size_t>(r)];
      const auto* got = static_cast<const std::uint8_t*>(res.recv_x.data()) + std::int64_t{r} * rb;
      if (owner < 0) {
        if (!opt.zero_padding) continue;
        bool zero = std::all_of(got, got + rb, [](std::uint8_t b) { return b == 0; });
        for (int p = 0; p < spec.scale_cols && spec.fp8; ++p) zero &= scale_at(res.recv_x_scales, r, p) == 0;
        if (spec.weights) zero &= res.recv_topk_weights.data_as<const float>()[r] == 0.0f;
        if (!zero) bad.add("padding row {} is not zero", r);
        continue;
      }
      const auto& row = ref.rows[static_cast<size_t>(owner)];
      const RankInputs& src = all[static_cast<size_t>(row.source)];
      if (!same_bytes(got, &src.x[static_cast<size_t>(row.token) * rb], static_cast<size_t>(rb)))
        bad.add("expanded recv_x row {} differs from rank {} token {}", r, row.source, row.token);
      for (int p = 0; p < spec.scale_cols && spec.fp8; ++p)
        if (scale_at(res.recv_x_scales, r, p) != src.scales[static_cast<size_t>(row.token * spec.scale_cols + p)])
          bad.add("expanded recv_x_scales[{}, {}] wrong", r, p);
      if (spec.weights && res.recv_topk_weights.data_as<const float>()[r] != src.weights[static_cast<size_t>(row.token * k + lane)])
        bad.add("expanded recv_topk_weights[{}] wrong", r);
    }
  }

}

// Source side: slots at the destinations' master lanes.
void verify_source_slots(const CaseSpec& spec, const RunOptions& opt, const std::vector<RankInputs>& all,
                         const reference::RefDispatch& ref, const DispatchResult& res, int me, Mismatches& bad) {
  const int k = spec.k, El = spec.experts_per_rank();
  const EPHandle& h = *res.handle;
  const RankInputs& mine = all[static_cast<size_t>(me)];
  std::vector<int> next(static_cast<size_t>(spec.ranks), 0);
  for (int t = 0; t < mine.num_tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = mine.topk[static_cast<size_t>(t * k + j)];
      bool master = e >= 0;
      for (int l = j + 1; l < k && master; ++l)
        master = !(mine.topk[static_cast<size_t>(t * k + l)] >= 0 && mine.topk[static_cast<size_t>(t * k + l)] / El == e / El);
      const int expected = master ? me * spec.max_tokens + next[static_cast<size_t>(e / El)] : -1;
      if (h.dst_buffer_slot_idx.data_as<const std::int32_t>()[t * k + j] != expected)
        bad.add("dst_buffer_slot_idx[{}, {}] = {}, expected {}", t, j, h.dst_buffer_slot_idx.data_as<const std::int32_t>()[t * k + j],
                expected);
    }
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = mine.topk[static_cast<size_t>(t * k + j)];
      bool master = e >= 0;
      for (int l = j + 1; l < k && master; ++l)
        master = !(mine.topk[static_cast<size_t>(t * k + l)] >= 0 && mine.topk[static_cast<size_t>(t * k + l)] / El == e / El);
      if (master) ++next[static_cast<size_t>(e / El)];
    }
  }
}

// Compares a dispatch result with the reference.
void verify_dispatch(const CaseSpec& spec, const RunOptions& opt, const std::vector<RankInputs>& all,
                     const reference::RefDispatch& ref, const DispatchResult& res, int me, Mismatches& bad) {
  verify_counts(spec, opt, all, ref, res, me, bad);
  verify_received_rows(spec, opt, all, ref, res, me, bad);
  verify_layout_rows(spec, opt, all, ref, res, me, bad);
  verify_source_slots(spec, opt, all, ref, res, me, bad);
}

void expect_same_tensor(const Tensor& a, const Tensor& b, std::int64_t rows, const char* name, Mismatches& bad) {
  if (a.defined() != b.defined()) {
    bad.add("cached {}: defined differs", name);
    return;
  }
  if (!a.defined()) return;
  if (a.ndim() != b.ndim() || a.size(0) != b.size(0)) {
    bad.add("cached {}: shape {} vs {}", name, a.describe(), b.describe());
    return;
  }
  const std::int64_t cols = a.ndim() == 1 ? 1 : a.size(1);
  const std::size_t es = element_size(a.dtype());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t oa = a.ndim() == 1 ? r * a.stride(0) : r * a.stride(0) + c * a.stride(1);
      const std::int64_t ob = b.ndim() == 1 ? r * b.stride(0) : r * b.stride(0) + c * b.stride(1);
      if (!same_bytes(static_cast<const char*>(a.data()) + oa * static_cast<std::int64_t>(es),
                      static_cast<const char*>(b.data()) + ob * static_cast<std::int64_t>(es), es)) {
        bad.add("cached {} differs at row {} column {}", name, r, c);
        return;
      }
    }
}

// The handle's topk_idx: a copy of the caller's (do_handle_copy) or the caller's tensor itself.
void check_handle_topk(const CaseSpec& spec, const RunOptions& opt, const RankInputs& in, const TensorView& topk,
                       const DispatchResult& res, Mismatches& bad) {
  const std::int64_t n = in.num_tokens;
  const int k = spec.k;
  const Tensor& held = res.handle->topk_idx;
  if (!held.defined() || held.size(0) != n || held.size(1) != k) {
    bad.add("handle.topk_idx is not [N, k]");
  } else if (opt.handle_copy) {
    if (held.data() == topk.data()) bad.add("do_handle_copy = true, but handle.topk_idx is the caller's tensor");
    for (std::int64_t t = 0; t < n; ++t)
      for (int j = 0; j < k; ++j)
        if (held.data_as<const std::int64_t>()[t * held.stride(0) + j * held.stride(1)] != in.topk[static_cast<size_t>(t * k + j)])
          bad.add("handle.topk_idx[{}, {}] differs from topk_idx", t, j);
  } else if (held.data() != topk.data()) {
    bad.add("do_handle_copy = false, but handle.topk_idx is not the caller's tensor");
  }
}

// A cached dispatch of these x, scales and weights with the first call's handle.
DispatchArgs cached_args(const CaseSpec& spec, const RunOptions& opt, const DispatchResult& res, const TensorView& cx,
                         const TensorView& cscales, const TensorView& cweights) {
  DispatchArgs again{.x = cx,
                     .num_max_tokens_per_rank = spec.max_tokens,
                     .expert_alignment = spec.alignment,
                     .async_with_compute_stream = opt.async,
                     .handle = res.handle,
                     .do_expand = spec.expand,
                     .do_zero_padding = opt.zero_padding,
                     .use_tma_aligned_col_major_sf = opt.col_major_scales};
  if (opt.cached_defaults) {
    again.num_max_tokens_per_rank = 0;
    again.expert_alignment = 0;
    again.do_expand = false;
  }
  if (spec.fp8) again.x_scales = cscales;
  if (spec.weights) again.topk_weights = cweights;
  return again;
}

// A cached dispatch of the same inputs returns the first call's handle and rows.
void check_cached_replay(ElasticBuffer& buffer, const CaseSpec& spec, const RunOptions& opt, DType x_dtype,
                         const reference::RefDispatch& ref, const DispatchResult& res, const TensorView& x,
                         const TensorView& scales, const TensorView& weights, Mismatches& bad) {
  DispatchResult cached = buffer.dispatch(cached_args(spec, opt, res, x, scales, weights));
  cached.event.wait();
  if (cached.handle != res.handle) bad.add("cached dispatch must return the same handle");
  if (cached.recv_x.dtype() != x_dtype) bad.add("cached recv_x has dtype {}", dtype_name(cached.recv_x.dtype()));
  const std::int64_t rows = spec.expand ? (opt.zero_padding ? ref.expanded_rows : 0) : std::int64_t(ref.rows.size());
  expect_same_tensor(cached.recv_x, res.recv_x, rows, "recv_x", bad);
  expect_same_tensor(cached.recv_x_scales, res.recv_x_scales, rows, "recv_x_scales", bad);
  expect_same_tensor(cached.recv_topk_idx, res.recv_topk_idx, rows, "recv_topk_idx", bad);
  expect_same_tensor(cached.recv_topk_weights, res.recv_topk_weights, rows, "recv_topk_weights", bad);
  if (spec.expand && !opt.zero_padding) {
    for (int r = 0; r < ref.expanded_rows; ++r)  // padding rows are unspecified without zero padding
      if (ref.expanded_owner[static_cast<size_t>(r)].first >= 0 &&
          !same_bytes(static_cast<const char*>(cached.recv_x.data()) + std::int64_t{r} * spec.row_bytes(),
                      static_cast<const char*>(res.recv_x.data()) + std::int64_t{r} * spec.row_bytes(),
                      static_cast<size_t>(spec.row_bytes())))
        bad.add("cached expanded recv_x row {} differs", r);
  }
}

// New x, scales and weights for the same routing: the handle places them, nothing of the first
// call's data may show.
void check_replay_with_new_inputs(ElasticBuffer& buffer, const CaseSpec& spec, const RunOptions& opt, DType x_dtype,
                                  const std::vector<RankInputs>& all, int me, const DispatchResult& res, Mismatches& bad) {
  const int k = spec.k, H = spec.hidden;
  const std::int64_t n = all[static_cast<size_t>(me)].num_tokens;
  CaseSpec fresh_spec = spec;
  fresh_spec.seed = spec.seed * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
  std::vector<RankInputs> fresh;
  for (int r = 0; r < spec.ranks; ++r) {
    fresh.push_back(reference::make_inputs(fresh_spec, r));
    fresh.back().topk = all[static_cast<size_t>(r)].topk;
  }
  RankInputs& mine = fresh[static_cast<size_t>(me)];
  DispatchResult replay = buffer.dispatch(
      cached_args(spec, opt, res, TensorView(mine.x.data(), x_dtype, {n, H}),
                  spec.fp8 ? TensorView(mine.scales.data(), DType::kFP32, {n, spec.scale_cols}) : TensorView(),
                  spec.weights ? TensorView(mine.weights.data(), DType::kFP32, {n, k}) : TensorView()));
  replay.event.wait();
  if (replay.handle != res.handle) bad.add("cached dispatch must return the same handle");
  bad.set_context("cached dispatch with new inputs: ");
  verify_dispatch(spec, opt, fresh, reference::reference_dispatch(spec, fresh, me), replay, me, bad);
  bad.set_context("");
}

// Combine: expert outputs depend on (this rank, local expert, source token), so a row routed to
// the wrong place shows up in the combined result.
CombineResult check_combine(ElasticBuffer& buffer, const CaseSpec& spec, const RunOptions& opt,
                            std::vector<RankInputs>& all, int me, const reference::RefDispatch& ref,
                            const DispatchResult& res, Mismatches& bad) {
  const int k = spec.k, H = spec.hidden;
  RankInputs& in = all[static_cast<size_t>(me)];
  const std::int64_t n = in.num_tokens;
  const auto* meta = res.handle->recv_src_metadata.data_as<const std::int32_t>();
  const std::int64_t rows = res.recv_x.size(0);
  Tensor y = Tensor::empty({rows, H}, DType::kBF16);
  std::fill(y.data_as<std::uint16_t>(), y.data_as<std::uint16_t>() + rows * H, kPoison);
  Tensor y_weights = spec.weights ? Tensor::empty(res.recv_topk_weights.shape(), DType::kFP32) : Tensor();
  if (spec.weights)
    for (std::int64_t i = 0; i < y_weights.numel(); ++i)
      y_weights.data_as<float>()[i] = res.recv_topk_weights.data_as<const float>()[i] * kWeightScale;
  for (std::size_t i = 0; i < ref.rows.size(); ++i) {
    const int src_global = meta[i * static_cast<size_t>(k + 2)];
    for (int j = 0; j < k; ++j) {
      const int r = spec.expand ? meta[i * static_cast<size_t>(k + 2) + 2 + static_cast<size_t>(j)] : static_cast<int>(i);
      if (r < 0) continue;
      const int local = spec.expand ? static_cast<int>(ref.rows[i].local_ids[static_cast<size_t>(j)]) : -1;
      for (int h = 0; h < H; ++h) y.data_as<std::uint16_t>()[std::int64_t{r} * H + h] = spec.value(me, local, src_global, h);
    }
  }
  CombineArgs cargs{.x = y, .handle = res.handle, .async_with_compute_stream = opt.async};
  if (spec.weights) cargs.topk_weights = y_weights;
  for (auto& b : in.bias) cargs.bias.push_back(TensorView(b.data(), DType::kBF16, {n, H}));
  CombineResult combined = buffer.combine(cargs);
  combined.event.wait();
  const auto ref_combined = reference::reference_combine(spec, all, me, kWeightScale);
  for (std::int64_t t = 0; t < n; ++t) {
    if (!same_bytes(combined.combined_x.data_as<const std::uint16_t>() + t * H, &ref_combined.x[static_cast<size_t>(t * H)],
                    sizeof(std::uint16_t) * static_cast<size_t>(H))) {
      int h = 0;
      while (combined.combined_x.data_as<const std::uint16_t>()[t * H + h] == ref_combined.x[static_cast<size_t>(t * H + h)]) ++h;
      bad.add("combined_x[{}] differs first at h={}: {} vs reference {}", t, h,
              reference::float_from_bf16(combined.combined_x.data_as<const std::uint16_t>()[t * H + h]),
              reference::float_from_bf16(ref_combined.x[static_cast<size_t>(t * H + h)]));
    }
    for (int j = 0; j < k && spec.weights; ++j)
      if (combined.combined_topk_weights.data_as<const float>()[t * k + j] != ref_combined.weights[static_cast<size_t>(t * k + j)])
        bad.add("combined_topk_weights[{}, {}] = {}, expected {}", t, j,
                combined.combined_topk_weights.data_as<const float>()[t * k + j], ref_combined.weights[static_cast<size_t>(t * k + j)]);
  }
  if (!spec.weights && combined.combined_topk_weights.defined()) bad.add("combined_topk_weights defined without weights");
  return combined;
}

// A digest of this rank's outputs (received rows, handle counts, combined rows and weights).
std::uint64_t outputs_digest(const CaseSpec& spec, const reference::RefDispatch& ref, const DispatchResult& res,
                             const CombineResult& combined) {
  const int k = spec.k;
  std::uint64_t d = 1469598103934665603ULL;
  auto mix = [&](const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) d = (d ^ p[i]) * 1099511628211ULL;
  };
  const std::int64_t real_rows = spec.expand ? ref.expanded_rows : static_cast<std::int64_t>(ref.rows.size());
  for (std::int64_t r = 0; r < real_rows; ++r)  // padding rows are unspecified without zero padding
    if (!spec.expand || ref.expanded_owner[static_cast<size_t>(r)].first >= 0)
      mix(static_cast<const std::byte*>(res.recv_x.data()) + r * spec.row_bytes(), static_cast<std::size_t>(spec.row_bytes()));
  mix(res.handle->recv_src_metadata.data(), static_cast<std::size_t>(ref.rows.size()) * (k + 2) * sizeof(std::int32_t));
  mix(res.handle->psum_num_recv_tokens_per_expert.data(), res.handle->psum_num_recv_tokens_per_expert.nbytes());
  mix(combined.combined_x.data(), combined.combined_x.nbytes());
  if (spec.weights) mix(combined.combined_topk_weights.data(), combined.combined_topk_weights.nbytes());
  return d;
}

// The first dispatch of a case: this rank's inputs as views, and the call's arguments.
struct FirstDispatch {
  TensorView x, scales, topk, weights;
  DispatchArgs args;
};

FirstDispatch first_dispatch(const CaseSpec& spec, const RunOptions& opt, RankInputs& in, DType x_dtype,
                             const TensorView& stats) {
  const std::int64_t n = in.num_tokens;
  FirstDispatch f{.x = TensorView(in.x.data(), x_dtype, {n, spec.hidden}),
                  .scales = TensorView(in.scales.data(), DType::kFP32, {n, spec.scale_cols}),
                  .topk = TensorView(in.topk.data(), DType::kInt64, {n, spec.k}),
                  .weights = TensorView(in.weights.data(), DType::kFP32, {n, spec.k})};
  f.args = DispatchArgs{.x = f.x,
                        .topk_idx = f.topk,
                        .cumulative_local_expert_recv_stats = stats,
                        .num_experts = spec.num_experts,
                        .expert_alignment = spec.alignment,
                        .num_sms = opt.num_sms,
                        .async_with_compute_stream = opt.async,
                        .do_handle_copy = opt.handle_copy,
                        .do_cpu_sync = opt.cpu_sync,
                        .do_expand = spec.expand,
                        .do_zero_padding = opt.zero_padding,
                        .use_tma_aligned_col_major_sf = opt.col_major_scales};
  if (spec.fp8) f.args.x_scales = f.scales;
  if (spec.weights) f.args.topk_weights = f.weights;
  return f;
}

}  // namespace

std::vector<std::string> run_elastic_case(Group& group, const CaseSpec& spec, const RunOptions& opt) {
  const int me = group.rank(), k = spec.k, H = spec.hidden;
  Mismatches bad(me);
  const DType x_dtype = opt.payload_dtype ? *opt.payload_dtype : spec.fp8 ? DType::kFP8E4M3 : DType::kBF16;
  if (opt.payload_dtype && static_cast<int>(element_size(x_dtype)) != spec.payload_element_bytes) {
    bad.add("the case's payload_element_bytes {} is not the size of {}", spec.payload_element_bytes, dtype_name(x_dtype));
    return std::move(bad.list());
  }
  // Rows wider than BF16's (4-byte payloads) need the buffer of a BF16 dispatch of twice the hidden.
  const std::int64_t num_bytes =
      spec.payload_element_bytes > 2
          ? ElasticBuffer::get_buffer_size_hint(group, spec.max_tokens, H * spec.payload_element_bytes / 2, k, false,
                                                spec.allow_hybrid, spec.multi)
          : 0;
  ElasticBuffer buffer(group, {.num_bytes = num_bytes,
                               .num_max_tokens_per_rank = spec.max_tokens,
                               .hidden = H,
                               .num_topk = k,
                               .use_fp8_dispatch = spec.fp8,
                               .allow_hybrid_mode = spec.allow_hybrid,
                               .allow_multiple_reduction = spec.multi,
                               .num_allocated_qps = opt.num_allocated_qps,
                               .num_cpu_timeout_secs = 120});
  std::vector<RankInputs> all = reference::make_all_inputs(spec);
  RankInputs& in = all[static_cast<size_t>(me)];
  const std::int64_t n = in.num_tokens;
  Tensor stats = Tensor::zeros({spec.experts_per_rank()}, DType::kInt32);
  const FirstDispatch first = first_dispatch(spec, opt, in, x_dtype, stats);
  const TensorView &x = first.x, &scales = first.scales, &topk = first.topk, &weights = first.weights;
  const DispatchArgs& args = first.args;
  DispatchResult res = buffer.dispatch(args);
  res.event.wait();
  if (res.recv_x.dtype() != x_dtype)
    bad.add("recv_x has dtype {}, x has {}", dtype_name(res.recv_x.dtype()), dtype_name(x_dtype));
  if (n > 0) check_handle_topk(spec, opt, in, topk, res, bad);
  const auto ref = reference::reference_dispatch(spec, all, me);
  verify_dispatch(spec, opt, all, ref, res, me, bad);
  for (int i = 0; i < spec.experts_per_rank(); ++i)
    if (stats.data_as<std::int32_t>()[i] != ref.unaligned[static_cast<size_t>(i)])
      bad.add("cumulative_local_expert_recv_stats[{}] = {}, expected {}", i, stats.data_as<std::int32_t>()[i],
              ref.unaligned[static_cast<size_t>(i)]);

  if (opt.cached) check_cached_replay(buffer, spec, opt, x_dtype, ref, res, x, scales, weights, bad);
  if (opt.cached && opt.cached_new_inputs) check_replay_with_new_inputs(buffer, spec, opt, x_dtype, all, me, res, bad);
  const CombineResult combined = check_combine(buffer, spec, opt, all, me, ref, res, bad);
  if (opt.digest) *opt.digest = outputs_digest(spec, ref, res, combined);
  return std::move(bad.list());
}

RankProblems run_elastic_case_in_process(const CaseSpec& spec, const RunOptions& options) {
  return collect_on_ranks(spec.ranks, {.num_scaleout = spec.scaleout},
                          [&](Group& g, std::vector<std::string>& problems) { problems = run_elastic_case(g, spec, options); });
}

void expect_elastic_case(const CaseSpec& spec, const RunOptions& options) {
  report_problems(run_elastic_case_in_process(spec, options), {.context = describe(spec, options)});
}

std::vector<std::uint64_t> in_process_digests(const CaseSpec& spec, RunOptions options) {
  std::vector<std::uint64_t> digests(static_cast<size_t>(spec.ranks), 0);
  LocalWorld world(spec.ranks, {.num_scaleout = spec.scaleout});
  world.run([&](Group& g) {
    RunOptions o = options;
    o.digest = &digests[static_cast<size_t>(g.rank())];
    run_elastic_case(g, spec, o);
  });
  return digests;
}

CaseSpec random_case(std::uint64_t seed, RunOptions* options) { return random_case(seed, 0, 0, options); }

CaseSpec random_case(std::uint64_t seed, int ranks, int scaleout, RunOptions* options) {
  std::mt19937_64 rng(seed * 2654435761ULL + 17);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  CaseSpec s;
  s.seed = seed;
  s.ranks = pick(1, 8);
  if ((s.ranks == 4 || s.ranks == 8) && chance(0.5)) s.scaleout = s.ranks == 4 ? 2 : (chance(0.5) ? 2 : 4);
  if (s.ranks == 6 && chance(0.3)) s.scaleout = chance(0.5) ? 2 : 3;
  if (ranks > 0) {
    s.ranks = ranks;
    s.scaleout = scaleout;
  }
  s.allow_hybrid = chance(0.7);
  s.multi = chance(0.6);
  const int per_rank = chance(0.3) ? pick(1, 2) : pick(1, 32);
  s.num_experts = per_rank * s.ranks;
  s.k = pick(1, std::min(8, s.num_experts));
  s.max_tokens = pick(1, 24);
  s.fp8 = chance(0.4);
  s.hidden = s.fp8 ? 128 * pick(1, 2) : 64 * pick(1, 3);
  s.scale_cols = s.fp8 ? (chance(0.5) ? s.hidden / 128 : s.hidden / 32) : 0;
  s.expand = chance(0.5);
  s.alignment = s.expand ? (chance(0.4) ? 1 : chance(0.5) ? 4 : 128) : (chance(0.5) ? 1 : 8);
  s.weights = chance(0.8);
  s.num_bias = pick(0, 2);
  s.mask_ratio = chance(0.4) ? 0.25 : 0.0;
  s.skew = chance(0.4) ? 1.5 : 0.0;
  for (int r = 0; r < s.ranks; ++r) {
    const int roll = pick(0, 9);
    s.tokens.push_back(roll == 0 ? 0 : roll == 1 ? s.max_tokens : pick(0, s.max_tokens));
  }
  RunOptions o;
  o.async = chance(0.4);
  o.cpu_sync = chance(0.75);
  o.cached = true;
  o.zero_padding = s.expand && chance(0.5);
  o.col_major_scales = s.fp8 && chance(0.3);
  o.num_sms = chance(0.3) ? pick(1, 3) : 0;
  *options = o;
  return s;
}

ElasticCalls::ElasticCalls(const CaseSpec& spec, const RunOptions& options, int rank)
    : spec_(spec), options_(options), rank_(rank), all_(reference::make_all_inputs(spec)),
      ref_(reference::reference_dispatch(spec, all_, rank)) {}

DispatchResult ElasticCalls::dispatch(ElasticBuffer& buffer, std::vector<std::string>& problems) {
  Mismatches bad(rank_);
  const FirstDispatch first =
      first_dispatch(spec_, options_, all_[static_cast<size_t>(rank_)], spec_.fp8 ? DType::kFP8E4M3 : DType::kBF16, {});
  DispatchResult res = buffer.dispatch(first.args);
  res.event.wait();
  verify_dispatch(spec_, options_, all_, ref_, res, rank_, bad);
  problems.insert(problems.end(), bad.list().begin(), bad.list().end());
  return res;
}

void ElasticCalls::combine(ElasticBuffer& buffer, const DispatchResult& dispatched, std::vector<std::string>& problems) {
  Mismatches bad(rank_);
  check_combine(buffer, spec_, options_, all_, rank_, ref_, dispatched, bad);
  problems.insert(problems.end(), bad.list().begin(), bad.list().end());
}

std::string describe(const CaseSpec& s, const RunOptions& o) {
  return fmt::format(
      "seed {} ranks {} topology {}x{} hybrid {} multi {} E {} k {} T {} H {} fp8 {} P {} expand {} align {} weights {} "
      "bias {} mask {} skew {} routing {} wide_range {} tokens [{}] async {} cpu_sync {} zero_pad {} col_major {} "
      "workers {} cached {} cached_new_inputs {} cached_defaults {} handle_copy {} payload {}",
      s.seed, s.ranks, s.scaleout, s.ranks / s.scaleout, s.allow_hybrid, s.multi, s.num_experts, s.k, s.max_tokens,
      s.hidden, s.fp8, s.scale_cols, s.expand, s.alignment, s.weights, s.num_bias, s.mask_ratio, s.skew,
      s.fixed_topk.empty() ? std::to_string(s.routing_style) : std::string("fixed"), s.wide_range,
      fmt::join(s.tokens, ","), o.async, o.cpu_sync, o.zero_padding, o.col_major_scales, o.num_sms, o.cached,
      o.cached_new_inputs, o.cached_defaults, o.handle_copy, o.payload_dtype ? dtype_name(*o.payload_dtype) : "default");
}

}  // namespace moe_ep::testing
