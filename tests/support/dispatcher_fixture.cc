#include "support/dispatcher_fixture.hh"

#include <fmt/format.h>

#include <cstring>
#include <mutex>

#include "reference/low_latency_reference.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep::testing {

CaseSpec make_spec(int ranks, int scaleout, int experts, int k, int max_tokens, int hidden, std::uint64_t seed,
                   const std::function<int(int)>& tokens_of) {
  CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.num_experts = experts;
  s.k = k;
  s.max_tokens = max_tokens;
  s.hidden = hidden;
  s.seed = seed;
  s.mask_ratio = 0.1;
  s.skew = 0.8;
  for (int r = 0; r < ranks; ++r)
    s.tokens.push_back(tokens_of ? tokens_of(r) : (ranks >= 4 && r == 1 ? 0 : std::max(0, max_tokens - r % 3)));
  return s;
}

Inputs to_tensors(const CaseSpec& s, const RankInputs& in) {
  const std::int64_t n = in.num_tokens;
  Inputs t{Tensor::empty({n, s.hidden}, DType::kBF16), Tensor::empty({n, s.k}, DType::kInt64),
           Tensor::empty({n, s.k}, DType::kFP32)};
  if (n == 0) return t;  // nothing to copy (and no source buffers)
  std::memcpy(t.x.data(), in.x.data(), in.x.size());
  std::memcpy(t.topk_idx.data(), in.topk.data(), in.topk.size() * sizeof(std::int64_t));
  std::memcpy(t.topk_weights.data(), in.weights.data(), in.weights.size() * sizeof(float));
  return t;
}

namespace {

const std::uint16_t* source_row(const CaseSpec& s, const std::vector<RankInputs>& all, int src, int t) {
  return reinterpret_cast<const std::uint16_t*>(all[static_cast<size_t>(src)].x.data()) + static_cast<std::int64_t>(t) * s.hidden;
}

// Row `row` of `got` (FP8 with scales, or BF16) equals the source token as the wire carries it.
void check_row(const CaseSpec& s, const Expectation& e, const std::vector<RankInputs>& all, int src, int t,
               const DispatchOutput& out, std::int64_t row, const std::string& where, std::vector<std::string>& bad) {
  const int H = s.hidden;
  const std::uint16_t* x = source_row(s, all, src, t);
  if (!e.fp8) {
    if (std::memcmp(out.hidden_states.data_as<std::uint16_t>() + row * H, x, sizeof(std::uint16_t) * static_cast<size_t>(H)) != 0)
      bad.push_back(fmt::format("{} is not rank {} token {}", where, src, t));
    return;
  }
  // The reference per-128 cast (numeric_reference.hh), not the library's quantizer.
  const reference::Fp8Row q = reference::quantize_row_fp8(x, H, e.round_scale, e.ue8m0);
  if (std::memcmp(out.hidden_states.data_as<std::uint8_t>() + row * H, q.codes.data(), static_cast<size_t>(H)) != 0)
    bad.push_back(fmt::format("{} differs from the FP8 cast of rank {} token {}", where, src, t));
  const TensorView& sc = out.hidden_states_scale;
  if (sc.size(1) != static_cast<std::int64_t>(q.scales.size())) {
    bad.push_back(fmt::format("{}: {} scale columns, expected {}", where, sc.size(1), q.scales.size()));
    return;
  }
  for (std::size_t p = 0; p < q.scales.size(); ++p)
    if (sc.data_as<std::uint32_t>()[row * sc.stride(0) + static_cast<std::int64_t>(p) * sc.stride(1)] != q.scales[p])
      bad.push_back(fmt::format("{}: scale {} differs", where, p));
}

std::vector<int> aligned_counts(const reference::RefDispatch& ref, int alignment) {
  std::vector<int> counts;
  for (int c : ref.unaligned) counts.push_back((c + alignment - 1) / alignment * alignment);
  return counts;
}

CaseSpec with_layout(CaseSpec s, const Expectation& e, bool expand) {
  s.expand = expand;
  s.alignment = e.alignment;
  s.multi = e.multiple_reduction;
  s.allow_hybrid = e.hybrid;
  return s;
}

}  // namespace

void check_dispatch(const CaseSpec& spec, const Expectation& e, const std::vector<RankInputs>& all, int me,
                    const DispatchOutput& out, std::vector<std::string>& bad) {
  const int k = spec.k;
  if (out.format == OutputFormat::kLowLatency) {
    reference::check_slab(spec, {.fp8 = e.fp8, .round_scale = e.round_scale, .ue8m0 = e.ue8m0,
                                 .rows_per_expert = out.hidden_states.ndim() == 3 ? out.hidden_states.size(1) : 0},
                          all, me, out.hidden_states, out.hidden_states_scale, out.masked_m, bad);
    return;
  }
  const CaseSpec s = with_layout(spec, e, out.format == OutputFormat::kV2Expanded);
  const reference::RefDispatch ref = reference::reference_dispatch(s, all, me);
  if (out.num_recv_tokens_per_expert != aligned_counts(ref, e.alignment))
    bad.push_back("num_recv_tokens_per_expert differs from the reference");
  if (out.format == OutputFormat::kNormal) {
    if (out.hidden_states.size(0) != static_cast<std::int64_t>(ref.rows.size())) {
      bad.push_back(fmt::format("{} rows received, expected {}", out.hidden_states.size(0), ref.rows.size()));
      return;
    }
    for (std::size_t r = 0; r < ref.rows.size(); ++r) {
      const auto& row = ref.rows[r];
      check_row(s, e, all, row.source, row.token, out, static_cast<std::int64_t>(r), fmt::format("row {}", r), bad);
      for (int j = 0; j < k; ++j) {
        const std::int64_t id = out.topk_ids.data_as<std::int64_t>()[r * k + static_cast<size_t>(j)];
        if (id != row.local_ids[static_cast<size_t>(j)]) bad.push_back(fmt::format("topk_ids[{}, {}] = {}", r, j, id));
        const float w = out.topk_weights.data_as<float>()[r * k + static_cast<size_t>(j)];
        const float want = id >= 0 ? all[static_cast<size_t>(row.source)].weights[static_cast<size_t>(row.token * k + j)] : 0.0f;
        if (w != want) bad.push_back(fmt::format("topk_weights[{}, {}] = {}, expected {}", r, j, w, want));
      }
    }
    return;
  }
  // Expanded: rows grouped by expert; padding rows are not checked.
  for (std::size_t i = 0; i < ref.unaligned.size(); ++i)
    if (!out.masked_m.defined() || out.masked_m.data_as<std::int32_t>()[i] != ref.unaligned[i])
      bad.push_back(fmt::format("masked_m[{}] differs from the reference count {}", i, ref.unaligned[i]));
  if (out.hidden_states.size(0) != ref.expanded_rows) {
    bad.push_back(fmt::format("{} expanded rows, expected {}", out.hidden_states.size(0), ref.expanded_rows));
    return;
  }
  for (int r = 0; r < ref.expanded_rows; ++r) {
    const auto [owner, lane] = ref.expanded_owner[static_cast<size_t>(r)];
    if (owner < 0) continue;
    const auto& row = ref.rows[static_cast<size_t>(owner)];
    check_row(s, e, all, row.source, row.token, out, r, fmt::format("expanded row {}", r), bad);
    const float want = all[static_cast<size_t>(row.source)].weights[static_cast<size_t>(row.token * k + lane)];
    if (out.topk_weights.data_as<float>()[r] != want) bad.push_back(fmt::format("expanded weight {}", r));
  }
}

Tensor expert_outputs(const CaseSpec& spec, const Expectation& e, const std::vector<RankInputs>& all, int me,
                      const DispatchOutput& out) {
  const int H = spec.hidden;
  if (out.format == OutputFormat::kLowLatency)
    return reference::slab_expert_outputs(spec, all, me, out.hidden_states.size(1));
  const CaseSpec s = with_layout(spec, e, out.format == OutputFormat::kV2Expanded);
  const reference::RefDispatch ref = reference::reference_dispatch(s, all, me);
  const std::int64_t rows = out.hidden_states.size(0);
  Tensor y = Tensor::zeros({rows, H}, DType::kBF16);
  for (std::int64_t r = 0; r < rows; ++r) {
    int owner = -1, local = -1;
    if (out.format == OutputFormat::kNormal) {
      owner = static_cast<int>(r);
    } else if (r < ref.expanded_rows) {
      owner = ref.expanded_owner[static_cast<size_t>(r)].first;
      if (owner >= 0)
        local = static_cast<int>(ref.rows[static_cast<size_t>(owner)].local_ids[static_cast<size_t>(ref.expanded_owner[static_cast<size_t>(r)].second)]);
    }
    if (owner < 0 || owner >= static_cast<int>(ref.rows.size())) continue;
    const auto& row = ref.rows[static_cast<size_t>(owner)];
    for (int h = 0; h < H; ++h)
      y.data_as<std::uint16_t>()[r * H + h] = s.value(me, local, row.source * s.max_tokens + row.token, h);
  }
  return y;
}

std::vector<std::uint16_t> expected_combine(const CaseSpec& spec, const Expectation& e, const std::vector<RankInputs>& all,
                                            int me, const DispatchOutput& out) {
  if (out.format == OutputFormat::kLowLatency) {
    if (out.generation == Generation::kV1) return reference::low_latency_combine_reference(spec, all[static_cast<size_t>(me)], me);
    CaseSpec s = with_layout(spec, e, true);  // V2: weighted lanes through V2's expanded combine
    s.weight_lanes = true;
    return reference::reference_combine(s, all, me, 1.0f).x;
  }
  return reference::reference_combine(with_layout(spec, e, out.format == OutputFormat::kV2Expanded), all, me, 1.0f).x;
}

void check_combined(const std::vector<std::uint16_t>& expected, const Tensor& got, const std::string& what,
                    std::vector<std::string>& bad) {
  if (static_cast<std::size_t>(got.numel()) != expected.size()) {
    bad.push_back(fmt::format("{}: {} elements, expected {}", what, got.numel(), expected.size()));
    return;
  }
  for (std::size_t i = 0; i < expected.size(); ++i)
    if (got.data_as<std::uint16_t>()[i] != expected[i]) {
      bad.push_back(fmt::format("{}: element {} is {:#06x}, expected {:#06x}", what, i, got.data_as<std::uint16_t>()[i],
                                expected[i]));
      return;
    }
}

void run_ranks(int ranks, Topology topology, const std::function<void(Group&, std::vector<std::string>&)>& fn) {
  report_problems(collect_on_ranks(ranks, topology, fn), {.name_rank = true, .max_per_rank = 8});
}

Expectation expectation(const DispatcherOptions& o) {
  return {.fp8 = *o.dispatch_dtype == WireDType::kFP8,
          .round_scale = o.round_scale,
          .ue8m0 = o.use_ue8m0,
          .alignment = o.expert_alignment,
          .multiple_reduction = o.allow_multiple_reduction.value_or(true),
          .hybrid = o.allow_hybrid_mode.value_or(true)};
}

// One batch through the dispatcher, checked end to end; returns the combined output.
Tensor run_batch(Group& g, TokenDispatcher& d, const CaseSpec& s, BatchKind kind, std::vector<std::string>& bad,
                 const std::string& label, int micro_batch) {
  std::vector<RankInputs> all = reference::make_all_inputs(s);
  const Inputs in = to_tensors(s, all[static_cast<size_t>(g.rank())]);
  const Expectation e = expectation(d.options());
  const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, kind, micro_batch);
  if (out.mode != d.resolve(kind)) bad.push_back(label + ": wrong mode");
  std::vector<std::string> problems;
  check_dispatch(s, e, all, g.rank(), out, problems);
  const Tensor y = expert_outputs(s, e, all, g.rank(), out);
  const Tensor combined = d.combine(y, micro_batch);
  check_combined(expected_combine(s, e, all, g.rank(), out), combined, "combined", problems);
  for (auto& p : problems) bad.push_back(fmt::format("{} ({} {} {}): {}", label, generation_name(out.generation),
                                                     mode_name(out.mode), format_name(out.format), p));
  return combined;
}

}  // namespace moe_ep::testing
