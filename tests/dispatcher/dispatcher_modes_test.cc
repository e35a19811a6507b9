// The dispatcher's modes on both generations, against the dense references: every output format,
// BF16 and FP8 wire formats, one node and two; V1 through the dispatcher is bit-identical to V1
// called directly; V2 gives the same results as V1 for the same routing (bit for bit in normal
// mode, within the documented extra rounding in low-latency mode); auto mode over a mixed
// sequence cleans the V1 low-latency buffer exactly on normal -> low-latency transitions.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "support/dispatcher_fixture.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "reference/low_latency_reference.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep::testing {
namespace dispatcher_modes_test {

constexpr int kHidden = 256, kExperts = 16, kTopk = 4, kCap = 8, kPrefillCap = 24;

DispatcherOptions base_options(bool v2, DispatchMode mode, bool fp8) {
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.num_topk = kTopk;
  o.use_v2 = v2;
  o.mode = mode;
  o.num_max_dispatch_tokens_per_rank = kCap;
  o.num_max_prefill_tokens_per_rank = kPrefillCap;
  o.dispatch_dtype = fp8 ? WireDType::kFP8 : WireDType::kBF16;
  o.timeout_secs = 60;
  o.provider_path = "cpu";
  return o;
}

struct ModeCase {
  bool v2;
  DispatchMode mode;
  bool fp8;
  int scaleout;
  bool expanded_normal = false;
  bool multiple_reduction = true;
};

std::string case_name(const ::testing::TestParamInfo<ModeCase>& info) {
  const ModeCase& c = info.param;
  return fmt::format("{}_{}_{}_{}nodes{}{}", c.v2 ? "V2" : "V1", mode_name(c.mode), c.fp8 ? "fp8" : "bf16", c.scaleout,
                     c.expanded_normal ? "_expanded" : "", c.multiple_reduction ? "" : "_single_reduction");
}

class Modes : public ::testing::TestWithParam<ModeCase> {};

TEST_P(Modes, OutputsAndCombineMatchTheReference) {
  const ModeCase c = GetParam();
  const int ranks = 4;
  run_ranks(ranks, {.num_scaleout = c.scaleout}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    DispatcherOptions o = base_options(c.v2, c.mode, c.fp8);
    o.v2_normal_layout = c.expanded_normal ? V2NormalLayout::kExpanded : V2NormalLayout::kCompact;
    o.allow_multiple_reduction = c.multiple_reduction;
    o.expert_alignment = c.expanded_normal ? 4 : 1;
    if (c.fp8 && c.v2) o.round_scale = o.use_ue8m0 = true;  // the packed scale format too
    TokenDispatcher d(cache, o);
    const bool ll = c.mode == DispatchMode::kLowLatency;
    for (int round = 0; round < 2; ++round) {
      const CaseSpec s = make_spec(ranks, c.scaleout, kExperts, kTopk, ll ? kCap : kPrefillCap, kHidden, 11 + round);
      run_batch(g, d, s, ll ? BatchKind::kDecode : BatchKind::kPrefill, bad, fmt::format("round {}", round));
    }
    const BufferCacheStats st = cache.stats();
    if (st.builds != 1 || st.reuses != 1) bad.push_back(fmt::format("builds {} reuses {}", st.builds, st.reuses));
    if (st.current_generation != (c.v2 ? Generation::kV2 : Generation::kV1)) bad.push_back("wrong generation built");
  });
}

INSTANTIATE_TEST_SUITE_P(
    Dispatcher, Modes,
    ::testing::Values(ModeCase{false, DispatchMode::kNormal, false, 1}, ModeCase{false, DispatchMode::kNormal, true, 2},
                      ModeCase{false, DispatchMode::kLowLatency, false, 1},
                      ModeCase{false, DispatchMode::kLowLatency, true, 2}, ModeCase{true, DispatchMode::kNormal, false, 1},
                      ModeCase{true, DispatchMode::kNormal, true, 2},
                      ModeCase{true, DispatchMode::kNormal, false, 2, true},
                      ModeCase{true, DispatchMode::kLowLatency, false, 1},
                      ModeCase{true, DispatchMode::kLowLatency, true, 1},
                      ModeCase{true, DispatchMode::kLowLatency, false, 2},
                      ModeCase{true, DispatchMode::kLowLatency, false, 1, false, false}),
    case_name);

void expect_same(const TensorView& a, const TensorView& b, const std::string& what, std::vector<std::string>& bad) {
  if (a.defined() != b.defined() || (a.defined() && (a.nbytes() != b.nbytes() || a.dtype() != b.dtype()))) {
    bad.push_back(what + ": shapes differ");
    return;
  }
  if (!a.defined()) return;
  // Compare element by element through the strides (the scale tensors are transposed views).
  std::vector<std::int64_t> index(static_cast<size_t>(a.ndim()), 0);
  const std::size_t es = element_size(a.dtype());
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    std::int64_t oa = 0, ob = 0, rest = i;
    for (int d = a.ndim() - 1; d >= 0; --d) {
      const std::int64_t idx = rest % a.size(d);
      rest /= a.size(d);
      oa += idx * a.stride(d);
      ob += idx * b.stride(d);
    }
    if (std::memcmp(static_cast<const std::byte*>(a.data()) + oa * static_cast<std::int64_t>(es),
                    static_cast<const std::byte*>(b.data()) + ob * static_cast<std::int64_t>(es), es) != 0) {
      bad.push_back(fmt::format("{}: element {} differs", what, i));
      return;
    }
  }
}

// Slabs [El, rows, H] (and their scales): the valid rows of every expert are identical.
void expect_same_slab(const DispatchOutput& a, const TensorView& b_x, const TensorView& b_scales, const TensorView& counts,
                      const std::string& what, std::vector<std::string>& bad) {
  const std::size_t row_bytes = static_cast<std::size_t>(a.hidden_states.size(2)) * element_size(a.hidden_states.dtype());
  for (std::int64_t i = 0; i < a.hidden_states.size(0); ++i) {
    if (a.masked_m.data_as<std::int32_t>()[i] != counts.data_as<std::int32_t>()[i]) bad.push_back(what + ": counts differ");
    for (std::int64_t t = 0; t < a.masked_m.data_as<std::int32_t>()[i]; ++t) {
      const std::int64_t row = i * a.hidden_states.size(1) + t;
      if (std::memcmp(static_cast<const std::byte*>(a.hidden_states.data()) + row * static_cast<std::int64_t>(row_bytes),
                      static_cast<const std::byte*>(b_x.data()) + row * static_cast<std::int64_t>(row_bytes), row_bytes) != 0)
        bad.push_back(fmt::format("{}: row {} of expert {} differs", what, t, i));
      const TensorView& sa = a.hidden_states_scale;
      for (std::int64_t p = 0; sa.defined() && p < sa.size(2); ++p)
        if (sa.data_as<std::uint32_t>()[i * sa.stride(0) + t * sa.stride(1) + p * sa.stride(2)] !=
            b_scales.data_as<std::uint32_t>()[i * b_scales.stride(0) + t * b_scales.stride(1) + p * b_scales.stride(2)])
          bad.push_back(fmt::format("{}: scale {} of row {} of expert {} differs", what, p, t, i));
    }
  }
}

// V2 off: the dispatcher's V1 results are bit-identical to calling V1's Buffer directly.
TEST(DispatcherV1, BitIdenticalToCallingV1Directly) {
  const int ranks = 4;
  for (bool fp8 : {false, true}) {
    run_ranks(ranks, {}, [&](Group& g, std::vector<std::string>& bad) {
      const CaseSpec s = make_spec(ranks, 1, kExperts, kTopk, kCap, kHidden, fp8 ? 3 : 4);
      std::vector<RankInputs> all = reference::make_all_inputs(s);
      const Inputs in = to_tensors(s, all[static_cast<size_t>(g.rank())]);
      const Expectation e{.fp8 = fp8};
      BufferCache cache(g);
      TokenDispatcher d(cache, base_options(false, DispatchMode::kAuto, fp8));
      // The direct calls, with DeepEP's sizing for the same shape.
      Buffer direct(g, {.num_nvl_bytes = 1 << 22,
                        .num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(kCap, kHidden, ranks, kExperts),
                        .low_latency_mode = true});
      // Normal mode.
      const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill);
      Fp8Tensor q;
      if (fp8) q = quantize_fp8(in.x);
      const DispatchLayout layout = direct.get_dispatch_layout(in.topk_idx, kExperts);
      LegacyDispatchArgs a{.x = fp8 ? q.data.view() : in.x.view(),
                           .num_tokens_per_rank = layout.num_tokens_per_rank,
                           .is_token_in_rank = layout.is_token_in_rank,
                           .num_tokens_per_expert = layout.num_tokens_per_expert,
                           .topk_idx = in.topk_idx,
                           .topk_weights = in.topk_weights};
      if (fp8) a.x_scales = q.scales;
      const LegacyDispatchResult want = direct.dispatch(a);
      expect_same(out.hidden_states, want.recv_x, "normal recv_x", bad);
      expect_same(out.hidden_states_scale, want.recv_x_scales, "normal recv_x_scales", bad);
      expect_same(out.topk_ids, want.recv_topk_idx, "normal recv_topk_idx", bad);
      expect_same(out.topk_weights, want.recv_topk_weights, "normal recv_topk_weights", bad);
      if (out.num_recv_tokens_per_expert != want.num_recv_tokens_per_expert_list) bad.push_back("normal counts differ");
      const Tensor y = expert_outputs(s, e, all, g.rank(), out);
      const Tensor combined = d.combine(y);
      const CombineResult want_combined = direct.combine({.x = y, .handle = want.handle});
      expect_same(combined, want_combined.combined_x, "normal combined_x", bad);

      // Low-latency mode (the dispatcher cleans after normal mode; so does the direct caller).
      direct.clean_low_latency_buffer(kCap, kHidden, kExperts);
      const DispatchOutput ll = d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kDecode);
      const LowLatencyDispatchResult want_ll = direct.low_latency_dispatch(
          {.x = in.x, .topk_idx = in.topk_idx, .num_max_dispatch_tokens_per_rank = kCap, .num_experts = kExperts, .use_fp8 = fp8});
      expect_same_slab(ll, want_ll.recv_x, want_ll.recv_x_scales, want_ll.packed_recv_count, "low-latency slab", bad);
      if (ll.hidden_states.dtype() != want_ll.recv_x.dtype() || ll.hidden_states.numel() != want_ll.recv_x.numel())
        bad.push_back("low-latency slab shapes differ");
      const Tensor y_ll = expert_outputs(s, e, all, g.rank(), ll);
      const Tensor combined_ll = d.combine(y_ll);
      const LowLatencyCombineResult want_ll_combined = direct.low_latency_combine(
          {.x = y_ll, .topk_idx = in.topk_idx, .topk_weights = in.topk_weights, .handle = want_ll.handle});
      expect_same(combined_ll, want_ll_combined.combined_x, "low-latency combined_x", bad);
      if (cache.stats().clean_calls != 1) bad.push_back(fmt::format("clean calls {}", cache.stats().clean_calls));
    });
  }
}

// V2 on: the same routing gives V1's results — bit for bit in normal mode; in low-latency mode
// the slab is identical and the combine differs only by V2's extra rounding of each weighted lane.
TEST(DispatcherV2, SameResultsAsV1ForTheSameRouting) {
  const int ranks = 4;
  run_ranks(ranks, {}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache_v1(g), cache_v2(g);
    TokenDispatcher v1(cache_v1, base_options(false, DispatchMode::kAuto, true));
    TokenDispatcher v2(cache_v2, base_options(true, DispatchMode::kAuto, true));
    for (BatchKind kind : {BatchKind::kPrefill, BatchKind::kDecode}) {
      const CaseSpec s = make_spec(ranks, 1, kExperts, kTopk, kCap, kHidden, 21);
      std::vector<RankInputs> all = reference::make_all_inputs(s);
      const Inputs in = to_tensors(s, all[static_cast<size_t>(g.rank())]);
      const Expectation e{.fp8 = true};
      const DispatchOutput a = v1.dispatch(in.x, in.topk_idx, in.topk_weights, kind);
      const DispatchOutput b = v2.dispatch(in.x, in.topk_idx, in.topk_weights, kind);
      if (a.format != b.format) bad.push_back("formats differ");
      const Tensor ya = expert_outputs(s, e, all, g.rank(), a), yb = expert_outputs(s, e, all, g.rank(), b);
      const Tensor ca = v1.combine(ya), cb = v2.combine(yb);
      if (kind == BatchKind::kPrefill) {
        expect_same(a.hidden_states, b.hidden_states, "normal rows", bad);
        expect_same(a.hidden_states_scale, b.hidden_states_scale, "normal scales", bad);
        expect_same(a.topk_ids, b.topk_ids, "normal topk_ids", bad);
        expect_same(a.topk_weights, b.topk_weights, "normal topk_weights", bad);
        expect_same(ca, cb, "normal combined", bad);
        continue;
      }
      expect_same_slab(b, a.hidden_states, a.hidden_states_scale, a.masked_m, "V2 slab against V1", bad);
      if (a.expected_m != b.expected_m) bad.push_back("expected_m differs");
      // |V2 - V1| <= 2^-8 sum_j |w_j y_j| + one BF16 ulp of the result (docs/dispatcher.md §5).
      const RankInputs& me = all[static_cast<size_t>(g.rank())];
      for (int t = 0; t < me.num_tokens; ++t)
        for (int h = 0; h < kHidden; ++h) {
          double magnitude = 0;
          for (int j = 0; j < kTopk; ++j) {
            const auto id = me.topk[static_cast<size_t>(t * kTopk + j)];
            if (id < 0) continue;
            const int El = kExperts / ranks;
            magnitude += std::fabs(me.weights[static_cast<size_t>(t * kTopk + j)] *
                                   reference::float_from_bf16(reference::expert_value(static_cast<int>(id / El), static_cast<int>(id % El),
                                                                         g.rank() * s.max_tokens + t, h)));
          }
          const float va = reference::float_from_bf16(ca.data_as<std::uint16_t>()[t * kHidden + h]);
          const float vb = reference::float_from_bf16(cb.data_as<std::uint16_t>()[t * kHidden + h]);
          const double bound = magnitude * std::ldexp(1.0, -8) + std::fabs(va) * std::ldexp(1.0, -7);
          if (std::fabs(va - vb) > bound) bad.push_back(fmt::format("token {} element {}: V1 {} V2 {}", t, h, va, vb));
        }
    }
  });
}

// Auto mode over prefill, decode, decode, prefill, decode: one buffer; V1 cleans on each
// normal -> low-latency transition (two here) and never otherwise; V2 never cleans.
TEST(DispatcherAuto, MixedSequenceWithCleanCallsCounted) {
  const int ranks = 4;
  for (bool v2 : {false, true}) {
    run_ranks(ranks, {}, [&](Group& g, std::vector<std::string>& bad) {
      BufferCache cache(g);
      TokenDispatcher d(cache, base_options(v2, DispatchMode::kAuto, false));
      const BatchKind sequence[] = {BatchKind::kPrefill, BatchKind::kDecode, BatchKind::kDecode, BatchKind::kPrefill,
                                    BatchKind::kDecode};
      int step = 0;
      std::vector<int> cleans;
      for (BatchKind kind : sequence) {
        const bool decode = kind == BatchKind::kDecode;
        const CaseSpec s = make_spec(ranks, 1, kExperts, kTopk, decode ? kCap : kPrefillCap, kHidden, 100 + step);
        run_batch(g, d, s, kind, bad, fmt::format("step {}", step));
        cleans.push_back(cache.stats().clean_calls);
        ++step;
      }
      const std::vector<int> want = v2 ? std::vector<int>{0, 0, 0, 0, 0} : std::vector<int>{0, 1, 1, 1, 2};
      if (cleans != want) bad.push_back(fmt::format("clean calls after each step: {}", fmt::join(cleans, ", ")));
      if (cache.stats().builds != 1) bad.push_back("one buffer serves both modes");
    });
  }
}

}  // namespace dispatcher_modes_test
}  // namespace moe_ep::testing
