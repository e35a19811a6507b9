// V1 low-latency mode: slab contents and counts per expert, FP8 casts, hooks, slot alternation,
// the clean requirement, zero-copy combine, across nodes, all against references built from
// every rank's inputs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "moe_ep/convert.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "reference/dense_reference.hh"
#include "reference/low_latency_reference.hh"
#include "support/errors.hh"
#include "support/legacy_harness.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace {

using reference::CaseSpec;
using reference::RankInputs;
using reference::expert_rows;
using testing::collect_on_ranks;
using testing::low_latency_rdma_bytes;
using testing::report_problems;

struct LLOptions {
  bool fp8 = false, round_scale = false, ue8m0 = false;
  bool hook = false, combine_hook = false, zero_copy = false, async = false;
  // zero_copy: combine is given another tensor of the slab's shape (NaN-filled); the rows must be
  // read from the combine buffer, x gives only the shape.
  bool zero_copy_shape_only = false;
  // Before the low-latency calls, a normal-mode call that needs more than the low-latency pool
  // (across logical nodes the Buffer grows it), then clean_low_latency_buffer.
  bool normal_call_first = false;
};

CaseSpec ll_spec(int ranks, int scaleout, int experts, int k, int N, int hidden, std::uint64_t seed) {
  return reference::low_latency_spec(ranks, scaleout, experts, k, N, hidden, seed, 1.0);
}

// Source info and layout ranges of each local expert's rows (V1 only).
void check_src_info_and_ranges(const CaseSpec& s, const std::vector<RankInputs>& all, int me, const LowLatencyDispatchResult& d,
                               std::vector<std::string>& bad) {
  const int El = s.experts_per_rank(), N = s.max_tokens;
  for (int i = 0; i < El; ++i) {
    const auto rows = expert_rows(s, all, me, i);
    std::vector<std::int64_t> begin(static_cast<size_t>(s.ranks), 0), count(static_cast<size_t>(s.ranks), 0);
    for (const auto& row : rows) ++count[static_cast<size_t>(row.first)];
    for (int src = 1; src < s.ranks; ++src) begin[static_cast<size_t>(src)] = begin[static_cast<size_t>(src) - 1] + count[static_cast<size_t>(src) - 1];
    for (int src = 0; src < s.ranks; ++src)
      if (d.handle->packed_recv_layout_range.data_as<std::int64_t>()[i * s.ranks + src] !=
          ((begin[static_cast<size_t>(src)] << 32) | count[static_cast<size_t>(src)]))
        bad.push_back(fmt::format("layout_range[{}, {}]", i, src));
    for (std::size_t row = 0; row < rows.size(); ++row)
      if (d.handle->packed_recv_src_info.data_as<std::int32_t>()[i * std::int64_t{s.ranks} * N + static_cast<std::int64_t>(row)] != rows[row].second)
        bad.push_back(fmt::format("src_info[{}, {}]", i, row));
  }
}

// Expert outputs, unweighted, into the slab `y`: each depends on (rank, expert, source token).
void fill_expert_outputs(const CaseSpec& s, const std::vector<RankInputs>& all, int me, TensorView& y) {
  const int El = s.experts_per_rank(), H = s.hidden, N = s.max_tokens;
  for (int i = 0; i < El; ++i) {
    const auto rows = expert_rows(s, all, me, i);
    for (std::size_t row = 0; row < rows.size(); ++row)
      for (int h = 0; h < H; ++h)
        y.data_as<std::uint16_t>()[i * y.stride(0) + static_cast<std::int64_t>(row) * y.stride(1) + h] =
            reference::expert_value(me, i, rows[row].first * N + rows[row].second, h);
  }
}

// A normal-mode call of the topology of `s` with 32 tokens of hidden 512 per rank, checked against
// the dense reference (2 x 32 x 1056 B across 2 nodes, more than the low-latency pools of the tests
// that use it), then the clean low-latency mode requires after it.
void normal_call_then_clean(Buffer& b, Group& g, const CaseSpec& s, std::vector<std::string>& bad) {
  CaseSpec normal = s;
  normal.seed = s.seed + 1000;
  normal.max_tokens = 32;
  normal.hidden = 512;
  normal.fp8 = false;
  normal.scale_cols = 0;
  normal.tokens.assign(static_cast<size_t>(s.ranks), 32);
  for (const auto& p : testing::run_legacy_case_on(b, g, normal, {})) bad.push_back("normal call: " + p);
  b.clean_low_latency_buffer(s.max_tokens, s.hidden, s.num_experts);
}

std::vector<std::string> run_ll(Group& g, const CaseSpec& s, const LLOptions& o, int rounds) {
  std::vector<std::string> bad;
  const int me = g.rank(), H = s.hidden, k = s.k, El = s.experts_per_rank(), N = s.max_tokens;
  Buffer b(g, {.num_rdma_bytes = low_latency_rdma_bytes(s), .low_latency_mode = true, .num_cpu_timeout_secs = 60});
  std::vector<RankInputs> all = reference::make_all_inputs(s);
  RankInputs& in = all[static_cast<size_t>(me)];
  const std::int64_t n = in.num_tokens;
  TensorView x(in.x.data(), DType::kBF16, {n, H});
  TensorView topk(in.topk.data(), DType::kInt64, {n, k});
  TensorView weights(in.weights.data(), DType::kFP32, {n, k});
  Tensor stats = Tensor::zeros({El}, DType::kInt32);
  if (o.normal_call_first) normal_call_then_clean(b, g, s, bad);
  for (int round = 0; round < rounds; ++round) {
    LowLatencyDispatchResult d = b.low_latency_dispatch({.x = x, .topk_idx = topk, .num_max_dispatch_tokens_per_rank = N,
                                                         .num_experts = s.num_experts,
                                                         .cumulative_local_expert_recv_stats = stats,
                                                         .use_fp8 = o.fp8, .round_scale = o.round_scale, .use_ue8m0 = o.ue8m0,
                                                         .async_finish = o.async, .return_recv_hook = o.hook});
    d.event.wait();
    if (o.hook) {
      // Before the hook the receive has not happened: no source info, stats untouched.
      const auto* info = d.handle->packed_recv_src_info.data_as<std::int32_t>();
      if (std::any_of(info, info + El * s.ranks * N, [](std::int32_t v) { return v != -1; }))
        bad.push_back("rows were received before the hook ran");
      if (stats.data_as<std::int32_t>()[0] != round * static_cast<int>(expert_rows(s, all, me, 0).size()))
        bad.push_back("stats were updated before the hook ran");
      g.barrier();  // the peers have published by now; the hook still has to copy
      d.hook();
    }
    reference::check_slab(s, {.fp8 = o.fp8, .round_scale = o.round_scale, .ue8m0 = o.ue8m0, .rows_per_expert = std::int64_t{s.ranks} * N},
                          all, me, d.recv_x, d.recv_x_scales, d.packed_recv_count, bad);
    check_src_info_and_ranges(s, all, me, d, bad);
    for (int i = 0; i < El; ++i)
      if (stats.data_as<std::int32_t>()[i] != (round + 1) * static_cast<int>(expert_rows(s, all, me, i).size()))
        bad.push_back(fmt::format("cumulative stats[{}]", i));

    // Expert outputs, unweighted: low-latency combine applies the weights.
    const std::int64_t slab_rows = static_cast<std::int64_t>(s.ranks) * N;
    Tensor own;
    TensorView y, x_arg;
    if (o.zero_copy) {
      y = b.get_next_low_latency_combine_buffer(*d.handle);
    } else {
      own = Tensor::empty({El, slab_rows, H}, DType::kBF16);
      y = own;
    }
    fill_expert_outputs(s, all, me, y);
    x_arg = y;
    if (o.zero_copy_shape_only) {
      own = Tensor::empty({El, slab_rows, H}, DType::kBF16);
      std::fill(own.data_as<std::uint16_t>(), own.data_as<std::uint16_t>() + El * slab_rows * H, 0x7fc1);
      x_arg = own;
    }
    Tensor out = Tensor::empty({n, H}, DType::kBF16);
    std::fill(out.data_as<std::uint16_t>(), out.data_as<std::uint16_t>() + n * H, 0x7fc1);
    LowLatencyCombineResult c = b.low_latency_combine({.x = x_arg, .topk_idx = topk, .topk_weights = weights, .handle = d.handle,
                                                       .zero_copy = o.zero_copy, .async_finish = o.async,
                                                       .return_recv_hook = o.combine_hook, .out = out});
    c.event.wait();
    if (o.combine_hook) {
      if (n > 0 && out.data_as<std::uint16_t>()[0] != 0x7fc1) bad.push_back("combine output written before the hook ran");
      g.barrier();
      c.hook();
    }
    if (c.combined_x.data() != out.data()) bad.push_back("combine must write into `out`");
    const auto expected = reference::low_latency_combine_reference(s, in, me);
    for (std::int64_t t = 0; t < n; ++t)
      if (std::memcmp(out.data_as<std::uint16_t>() + t * H, &expected[static_cast<size_t>(t * H)], sizeof(std::uint16_t) * static_cast<size_t>(H)) != 0)
        bad.push_back(fmt::format("round {}: combined token {} differs", round, t));
  }
  return bad;
}

void run(const CaseSpec& s, const LLOptions& o, int rounds = 2) {
  const auto failures = collect_on_ranks(s.ranks, {.num_scaleout = s.scaleout},
                                         [&](Group& g, std::vector<std::string>& bad) { bad = run_ll(g, s, o, rounds); });
  report_problems(failures, {.context = fmt::format("seed {} ranks {}x{}", s.seed, s.ranks, s.scaleout),
                             .name_rank = true,
                             .max_per_rank = 10});
}

TEST(LowLatency, Bf16SlabAndWeightedCombine) { run(ll_spec(4, 1, 16, 4, 6, 256, 1), {}); }
TEST(LowLatency, Fp8CastVariants) {
  run(ll_spec(4, 1, 8, 3, 5, 256, 2), {.fp8 = true});
  run(ll_spec(4, 1, 8, 3, 5, 256, 3), {.fp8 = true, .round_scale = true});
  run(ll_spec(4, 1, 8, 3, 5, 640, 4), {.fp8 = true, .round_scale = true, .ue8m0 = true});
}
TEST(LowLatency, HooksCompleteTheReceive) {
  run(ll_spec(4, 1, 16, 4, 6, 128, 5), {.hook = true});
  run(ll_spec(4, 1, 16, 4, 6, 128, 6), {.hook = true, .combine_hook = true});
}
TEST(LowLatency, ZeroCopyAndAsync) {
  run(ll_spec(4, 1, 16, 4, 6, 128, 7), {.zero_copy = true});
  run(ll_spec(4, 1, 16, 4, 6, 128, 8), {.async = true});
  run(ll_spec(4, 1, 16, 4, 6, 128, 13), {.zero_copy = true, .zero_copy_shape_only = true});
  run(ll_spec(4, 2, 8, 2, 4, 128, 14), {.zero_copy = true, .async = true, .zero_copy_shape_only = true});
}
TEST(LowLatency, AcrossNodes) {
  run(ll_spec(8, 2, 16, 4, 5, 128, 9), {});
  run(ll_spec(8, 4, 16, 5, 5, 128, 10), {.fp8 = true, .hook = true, .combine_hook = true});
  run(ll_spec(4, 2, 8, 2, 4, 128, 11), {.zero_copy = true});
}
// Low-latency mode after a normal-mode call grew the pool (2 logical nodes of 4 ranks: DeepEP's
// hints leave normal mode no pool there, docs/legacy.md §1).
TEST(LowLatency, AfterANormalCallGrewThePool) {
  run(ll_spec(4, 2, 8, 2, 4, 128, 15), {.normal_call_first = true});
  run(ll_spec(4, 2, 8, 2, 4, 128, 16), {.hook = true, .zero_copy = true, .normal_call_first = true});
}
TEST(LowLatency, RandomShapes) {
  std::mt19937 rng(12);
  for (int i = 0; i < 12; ++i) {
    const int ranks = std::uniform_int_distribution<int>(1, 8)(rng);
    const int scaleout = (ranks % 2 == 0 && i % 2) ? 2 : 1;
    const int experts = ranks * std::uniform_int_distribution<int>(1, 6)(rng);
    const int k = std::uniform_int_distribution<int>(1, std::min(6, experts))(rng);
    LLOptions o;
    o.fp8 = i % 3 == 0;
    o.hook = i % 4 == 1;
    o.zero_copy = i % 5 == 2;
    run(ll_spec(ranks, scaleout, experts, k, std::uniform_int_distribution<int>(1, 7)(rng), 128, 100 + i), o, 1);
  }
}

// ---- Slot rules, hooks and the clean requirement -------------------------------------------------

struct Small {
  explicit Small(int rank, int n = 4) : n(n) {
    x.assign(static_cast<size_t>(n * 128), float_to_bf16(1.0f + rank));
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < 2; ++j) topk.push_back((t + j * 3 + rank) % 8);
    weights.assign(static_cast<size_t>(n * 2), 0.5f);
  }
  LowLatencyDispatchArgs dispatch(int N = 4, bool hook = false) {
    return {.x = TensorView(x.data(), DType::kBF16, {n, 128}), .topk_idx = TensorView(topk.data(), DType::kInt64, {n, 2}),
            .num_max_dispatch_tokens_per_rank = N, .num_experts = 8, .use_fp8 = false, .return_recv_hook = hook};
  }
  std::int64_t n;
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
  std::vector<float> weights;
};

using testing::error_of;

TEST(LowLatencySlots, AtMostTwoLiveResultsAndHookRules) {
  LocalWorld(4).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(8, 128, 4, 8), .low_latency_mode = true});
    Small s(g.rank());
    auto a = b.low_latency_dispatch(s.dispatch(4, true));  // slot 0, hook pending
    auto c = b.low_latency_dispatch(s.dispatch(4, true));  // slot 1, hook pending
    const std::string third = error_of([&] { b.low_latency_dispatch(s.dispatch(4, true)); });  // slot 0 again
    EXPECT_NE(third.find("slot 0 still holds the result of low-latency call 1"), std::string::npos) << third;
    // The refused call changed nothing: the first result is still there, and its hook receives it.
    const std::string first = error_of([&] { a.hook(); });
    EXPECT_EQ(first, "");
    c.hook();
    const std::string twice = error_of([&] { c.hook(); });
    EXPECT_NE(twice.find("already called"), std::string::npos) << twice;
    auto d = b.low_latency_dispatch(s.dispatch());  // slot 0 (free again)
    // Handles whose slot was used again cannot be combined.
    auto e = b.low_latency_dispatch(s.dispatch());  // slot 1
    auto f = b.low_latency_dispatch(s.dispatch());  // slot 0: d's slot is recycled
    Tensor y = Tensor::zeros({2, 4 * 4, 128}, DType::kBF16);
    const std::string recycled = error_of([&] {
      b.low_latency_combine({.x = y, .topk_idx = TensorView(s.topk.data(), DType::kInt64, {s.n, 2}),
                             .topk_weights = TensorView(s.weights.data(), DType::kFP32, {s.n, 2}), .handle = d.handle});
    });
    EXPECT_NE(recycled.find("handle's slot 0 was used again"), std::string::npos) << recycled;
    // The latest handle still combines (two-micro-batch order: dispatch A, dispatch B, combine A).
    auto combined = b.low_latency_combine({.x = y, .topk_idx = TensorView(s.topk.data(), DType::kInt64, {s.n, 2}),
                                           .topk_weights = TensorView(s.weights.data(), DType::kFP32, {s.n, 2}),
                                           .handle = f.handle});
    EXPECT_EQ(combined.combined_x.size(0), s.n);
    EXPECT_THROW(ReceiveHook()(), StateError);
    (void)e;
  });
}

TEST(LowLatencySlots, CleanIsRequiredAfterAShapeChangeAndAfterNormalModeUsedThePool) {
  LocalWorld(4, {.num_scaleout = 2}).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(8, 128, 4, 8), .low_latency_mode = true});
    Small s(g.rank());
    b.low_latency_dispatch(s.dispatch(4));
    const std::string changed = error_of([&] { b.low_latency_dispatch(s.dispatch(8)); });
    EXPECT_NE(changed.find("changed from (4, 128, 8) to (8, 128, 8): call clean_low_latency_buffer(8, 128, 8) first"),
              std::string::npos) << changed;
    b.clean_low_latency_buffer(8, 128, 8);
    b.low_latency_dispatch(s.dispatch(8));
    // Normal mode across nodes uses the scale-out pool.
    auto layout = b.get_dispatch_layout(TensorView(s.topk.data(), DType::kInt64, {s.n, 2}), 8);
    auto d = b.dispatch({.x = TensorView(s.x.data(), DType::kBF16, {s.n, 128}),
                         .num_tokens_per_rank = layout.num_tokens_per_rank,
                         .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                         .is_token_in_rank = layout.is_token_in_rank,
                         .num_tokens_per_expert = layout.num_tokens_per_expert,
                         .topk_idx = TensorView(s.topk.data(), DType::kInt64, {s.n, 2})});
    const std::string dirty = error_of([&] { b.low_latency_dispatch(s.dispatch(8)); });
    EXPECT_NE(dirty.find("a normal-mode call used the scale-out pool since the last low-latency call: call "
                         "clean_low_latency_buffer first"), std::string::npos) << dirty;
    b.clean_low_latency_buffer(8, 128, 8);
    auto again = b.low_latency_dispatch(s.dispatch(8));
    EXPECT_EQ(again.packed_recv_count.size(0), 2);
  });
}

TEST(LowLatencyErrors, BadArgumentsAreNamed) {
  LocalWorld(2).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(4, 128, 2, 8), .low_latency_mode = true});
    Small s(g.rank(), 5);
    const std::string many = error_of([&] { b.low_latency_dispatch(s.dispatch(4)); });
    EXPECT_NE(many.find("x has 5 tokens, more than num_max_dispatch_tokens_per_rank = 4"), std::string::npos) << many;
    auto args = s.dispatch(8);
    args.use_ue8m0 = true;
    args.use_fp8 = true;
    EXPECT_NE(error_of([&] { b.low_latency_dispatch(args); }).find("use_ue8m0 = true requires round_scale = true"), std::string::npos);
    args = s.dispatch(8, true);
    args.async_finish = true;
    EXPECT_NE(error_of([&] { b.low_latency_dispatch(args); }).find("cannot both be true"), std::string::npos);
    args = s.dispatch(64);
    const std::string big = error_of([&] { b.low_latency_dispatch(args); });
    EXPECT_NE(big.find("need num_rdma_bytes >="), std::string::npos) << big;
    Buffer normal(g, {});
    EXPECT_NE(error_of([&] { normal.low_latency_dispatch(s.dispatch(8)); }).find("low_latency_mode = false"), std::string::npos);
  });
}

}  // namespace
}  // namespace moe_ep
