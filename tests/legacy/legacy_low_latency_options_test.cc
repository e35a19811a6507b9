// V1 low-latency options: the FP8 cast with round_scale and use_ue8m0 end to end (rows and
// scales against the reference quantizer of tests/reference, on inputs spanning the exponent
// range, one node and across nodes, with and without a receive hook); the wait-cost statistics
// (shape and dtype rules, accumulation of non-negative values, only for the sources that were
// waited for, untouched when not given or before the hook); and use_logfmt with zero_copy, which
// is refused (InvalidArgument on the rank that asks, PeerError naming it on the others, the buffer
// usable afterwards); and the signalled combine (overlap / src_signals): rows handed over only once
// a producer thread raised each expert's signal, and its argument checks; shrink mode with every
// rank masking one rank, against the reference of the inputs without the masked pairs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "reference/dense_reference.hh"
#include "reference/low_latency_reference.hh"
#include "support/errors.hh"
#include "support/legacy_harness.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace legacy_low_latency_options_test {

using reference::CaseSpec;
using reference::RankInputs;
using testing::catch_error;
using testing::Caught;
using testing::collect_on_ranks;
using testing::low_latency_rdma_bytes;
using testing::RankCall;
using testing::RankProblems;
using testing::report_problems;

CaseSpec ll_spec(int ranks, int scaleout, int experts, int k, int N, int hidden, std::uint64_t seed) {
  return reference::low_latency_spec(ranks, scaleout, experts, k, N, hidden, seed, 0.5);
}

// Every rank's problems (at most 10 of each) as test failures, each under `what` and naming its rank.
void report(const RankProblems& failures, const std::string& what) {
  report_problems(failures, {.context = what, .name_rank = true, .max_per_rank = 10});
}

// ---- FP8 cast options ----------------------------------------------------------------------------

struct CastCase {
  bool round_scale, ue8m0, hook;
};

void run_cast(const CaseSpec& s, const CastCase& c) {
  const auto failures = collect_on_ranks(s.ranks, {.num_scaleout = s.scaleout}, [&](Group& g, std::vector<std::string>& bad) {
    Buffer b(g, {.num_rdma_bytes = low_latency_rdma_bytes(s), .low_latency_mode = true, .num_cpu_timeout_secs = 60});
    std::vector<RankInputs> all = reference::make_all_inputs(s);
    RankInputs& in = all[static_cast<size_t>(g.rank())];
    const std::int64_t n = in.num_tokens;
    for (int round = 0; round < 2; ++round) {  // both slots
      LowLatencyDispatchResult d = b.low_latency_dispatch({.x = TensorView(in.x.data(), DType::kBF16, {n, s.hidden}),
                                                           .topk_idx = TensorView(in.topk.data(), DType::kInt64, {n, s.k}),
                                                           .num_max_dispatch_tokens_per_rank = s.max_tokens,
                                                           .num_experts = s.num_experts,
                                                           .use_fp8 = true,
                                                           .round_scale = c.round_scale,
                                                           .use_ue8m0 = c.ue8m0,
                                                           .return_recv_hook = c.hook});
      if (c.hook) d.hook();
      const DType scale_dtype = c.ue8m0 ? DType::kInt32 : DType::kFP32;
      const std::int64_t columns = c.ue8m0 ? (s.hidden / 128 + 3) / 4 : s.hidden / 128;
      if (d.recv_x.dtype() != DType::kFP8E4M3 || d.recv_x_scales.dtype() != scale_dtype || d.recv_x_scales.ndim() != 3 ||
          d.recv_x_scales.size(2) != columns)
        bad.push_back(fmt::format("recv_x {} / scales {}: expected float8_e4m3fn and {} [.., .., {}]", d.recv_x.describe(),
                                  d.recv_x_scales.describe(), dtype_name(scale_dtype), columns));
      reference::check_slab(s, {.fp8 = true, .round_scale = c.round_scale, .ue8m0 = c.ue8m0,
                                .rows_per_expert = std::int64_t{s.ranks} * s.max_tokens},
                            all, g.rank(), d.recv_x, d.recv_x_scales, d.packed_recv_count, bad);
    }
  });
  report(failures, fmt::format("seed {} {}x{} round_scale {} ue8m0 {} hook {}", s.seed, s.scaleout,
                               s.ranks / s.scaleout, c.round_scale, c.ue8m0, c.hook));
}

TEST(LowLatencyFp8, RoundScaleAndUe8m0CastsMatchTheReference) {
  const CastCase cases[] = {{false, false, false}, {true, false, false}, {true, true, false}, {true, true, true}};
  std::uint64_t seed = 500;
  for (const CastCase& c : cases) {
    for (int scaleout : {1, 2}) {
      CaseSpec s = ll_spec(4, scaleout, 16, 4, 5, 640, seed++);  // 5 blocks: a partly used UE8M0 word
      s.wide_range = true;
      run_cast(s, c);
    }
  }
  CaseSpec s = ll_spec(8, 4, 16, 3, 3, 512, seed);
  s.wide_range = true;
  run_cast(s, {true, true, true});
}

// ---- Wait-cost statistics ------------------------------------------------------------------------

constexpr std::int64_t kBase = std::int64_t{1} << 40;  // preloaded: accumulation must add to it

// Rank r's tokens select the experts (2r + 1 + t % 2) % 8 and (2r + 4 + t % 2) % 8: with 4 ranks
// of 2 experts each on 2 nodes, some ranks wait for one rank of the other node and not for the
// other (rank 1 receives from rank 3, not from rank 2; rank 0's tokens go to rank 2, not to rank 3).
std::vector<std::int64_t> stats_routing(int rank, int n) {
  std::vector<std::int64_t> ids;
  for (int t = 0; t < n; ++t) {
    ids.push_back((2 * rank + 1 + (t % 2)) % 8);
    ids.push_back((2 * rank + 4 + (t % 2)) % 8);
  }
  return ids;
}

// Which ranks `me` waits for: sources that send it rows (dispatch), ranks that hold experts of its
// tokens (combine); only those of another node are sure to take time.
void ranks_waited_for(int R, int El, int me, const std::vector<std::vector<std::int64_t>>& ids, std::vector<bool>& sends_to_me,
                      std::vector<bool>& serves_me) {
  sends_to_me.assign(static_cast<size_t>(R), false);
  serves_me.assign(static_cast<size_t>(R), false);
  for (int s = 0; s < R; ++s)
    for (auto id : ids[static_cast<size_t>(s)]) {
      if (id < 0) continue;
      if (id / El == me) sends_to_me[static_cast<size_t>(s)] = true;
      if (s == me) serves_me[static_cast<size_t>(id / El)] = true;
    }
}

// Waits for ranks of another node that sent rows take time on a nanosecond clock: over three
// rounds their entries (last_d: dispatch, last_c: combine) grew.
void check_remote_waits(int R, int scaleout, int me, const std::vector<bool>& sends_to_me, const std::vector<bool>& serves_me,
                        const std::vector<std::int64_t>& last_d, const std::vector<std::int64_t>& last_c,
                        std::vector<std::string>& bad) {
  const int per_node = R / scaleout;
  int remote_waits = 0;
  for (int s = 0; s < R; ++s) {
    if (s / per_node == me / per_node) continue;
    remote_waits += sends_to_me[static_cast<size_t>(s)] + serves_me[static_cast<size_t>(s)];
    if (sends_to_me[static_cast<size_t>(s)] && last_d[static_cast<size_t>(s)] == kBase)
      bad.push_back(fmt::format("dispatch_wait_recv_cost_stats[{}] never accumulated a wait for rank {}", s, s));
    if (serves_me[static_cast<size_t>(s)] && last_c[static_cast<size_t>(s)] == kBase)
      bad.push_back(fmt::format("combine_wait_recv_cost_stats[{}] never accumulated a wait for rank {}", s, s));
  }
  if (scaleout > 1 && remote_waits == 0) bad.push_back("the routing makes this rank wait for no rank of another node");
}

// Three rounds of dispatch and combine with both statistics given (and a round without them) on
// R ranks over `scaleout` nodes, rank r's tokens routed by ids[r] (n tokens, k lanes).
void run_stats(int R, int scaleout, int E, int k, int n, const std::vector<std::vector<std::int64_t>>& ids, bool hook,
               const std::string& what) {
  const int El = E / R, N = n, H = 128;
  const auto failures = collect_on_ranks(R, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
    const int me = g.rank(), per_node = R / scaleout;
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(N, H, R, E), .low_latency_mode = true});
    std::vector<std::uint16_t> x(static_cast<size_t>(N) * H, 0x3f80);
    std::vector<float> w(static_cast<size_t>(N) * k, 0.5f);
    std::vector<std::int64_t> mine = ids[static_cast<size_t>(me)];
    const TensorView xv(x.data(), DType::kBF16, {N, H}), topk(mine.data(), DType::kInt64, {N, k}),
        weights(w.data(), DType::kFP32, {N, k});
    std::vector<bool> sends_to_me, serves_me;
    ranks_waited_for(R, El, me, ids, sends_to_me, serves_me);
    Tensor dispatch_stats = Tensor::empty({R}, DType::kInt64), combine_stats = Tensor::empty({R}, DType::kInt64);
    std::fill(dispatch_stats.data_as<std::int64_t>(), dispatch_stats.data_as<std::int64_t>() + R, kBase);
    std::fill(combine_stats.data_as<std::int64_t>(), combine_stats.data_as<std::int64_t>() + R, kBase);
    std::vector<std::int64_t> last_d(static_cast<size_t>(R), kBase), last_c(static_cast<size_t>(R), kBase);
    auto check = [&](const Tensor& stats, std::vector<std::int64_t>& last, const std::vector<bool>& waited,
                     const char* name, int round) {
      for (int s = 0; s < R; ++s) {
        const std::int64_t v = stats.data_as<std::int64_t>()[s];
        const bool remote = s / per_node != me / per_node;
        if (v < last[static_cast<size_t>(s)])
          bad.push_back(fmt::format("round {}: {}[{}] went down from {} to {}", round, name, s, last[static_cast<size_t>(s)], v));
        if (remote && !waited[static_cast<size_t>(s)] && v != last[static_cast<size_t>(s)])
          bad.push_back(fmt::format("round {}: {}[{}] changed, but rank {} is on another node and not waited for",
                                    round, name, s, s));
        last[static_cast<size_t>(s)] = v;
      }
    };
    for (int round = 0; round < 3; ++round) {
      LowLatencyDispatchResult d = b.low_latency_dispatch({.x = xv, .topk_idx = topk, .num_max_dispatch_tokens_per_rank = N,
                                                           .num_experts = E, .dispatch_wait_recv_cost_stats = dispatch_stats,
                                                           .use_fp8 = false, .return_recv_hook = hook});
      if (hook) {
        for (int s = 0; s < R; ++s)
          if (dispatch_stats.data_as<std::int64_t>()[s] != last_d[static_cast<size_t>(s)])
            bad.push_back(fmt::format("dispatch stats changed before the receive hook ran (entry {})", s));
        d.hook();
      }
      check(dispatch_stats, last_d, sends_to_me, "dispatch_wait_recv_cost_stats", round);
      Tensor y = Tensor::zeros({El, std::int64_t{R} * N, H}, DType::kBF16);
      LowLatencyCombineResult c = b.low_latency_combine({.x = y, .topk_idx = topk, .topk_weights = weights, .handle = d.handle,
                                                         .return_recv_hook = hook, .combine_wait_recv_cost_stats = combine_stats});
      if (hook) {
        for (int s = 0; s < R; ++s)
          if (combine_stats.data_as<std::int64_t>()[s] != last_c[static_cast<size_t>(s)])
            bad.push_back(fmt::format("combine stats changed before the receive hook ran (entry {})", s));
        c.hook();
      }
      check(combine_stats, last_c, serves_me, "combine_wait_recv_cost_stats", round);
    }
    check_remote_waits(R, scaleout, me, sends_to_me, serves_me, last_d, last_c, bad);
    // Not given: nothing is written (the tensors keep their values through a round without them).
    LowLatencyDispatchResult d = b.low_latency_dispatch({.x = xv, .topk_idx = topk, .num_max_dispatch_tokens_per_rank = N,
                                                         .num_experts = E, .use_fp8 = false});
    Tensor y = Tensor::zeros({El, std::int64_t{R} * N, H}, DType::kBF16);
    b.low_latency_combine({.x = y, .topk_idx = topk, .topk_weights = weights, .handle = d.handle});
    for (int s = 0; s < R; ++s)
      if (dispatch_stats.data_as<std::int64_t>()[s] != last_d[static_cast<size_t>(s)] ||
          combine_stats.data_as<std::int64_t>()[s] != last_c[static_cast<size_t>(s)])
        bad.push_back(fmt::format("stats entry {} changed by calls that did not pass them", s));
  });
  report(failures, what);
}

TEST(LowLatencyStats, WaitCostsAccumulateForTheSourcesWaitedFor) {
  std::vector<std::vector<std::int64_t>> ids;
  for (int r = 0; r < 4; ++r) ids.push_back(stats_routing(r, 4));
  for (int scaleout : {1, 2})
    for (bool hook : {false, true}) run_stats(4, scaleout, 8, 2, 4, ids, hook, fmt::format("{} nodes, hook {}", scaleout, hook));
}

// Four nodes of two ranks, drawn routing with masks: every rank of another node that sent rows
// (or served experts) is counted, the others are left alone.
TEST(LowLatencyStats, FourNodesDrawnRouting) {
  CaseSpec s = ll_spec(8, 4, 16, 3, 3, 128, 81);
  s.mask_ratio = 0.3;
  for (int r = 0; r < 8; ++r) s.tokens[static_cast<size_t>(r)] = 3;
  std::vector<std::vector<std::int64_t>> ids;
  for (int r = 0; r < 8; ++r) ids.push_back(reference::make_inputs(s, r).topk);
  run_stats(8, 4, 16, 3, 3, ids, false, "4 nodes");
}

// Two ranks, four experts, four BF16 tokens of ones each sent to two experts with weight 1: the
// smallest call, for the argument checks.
struct TinyCall {
  static constexpr int R = 2, N = 4, H = 128, E = 4;
  std::vector<std::uint16_t> x = std::vector<std::uint16_t>(static_cast<size_t>(N) * H, 0x3f80);
  std::vector<std::int64_t> ids = {0, 1, 2, 3, 1, 2, 3, 0};
  std::vector<float> w = std::vector<float>(8, 1.0f);
  const TensorView topk{ids.data(), DType::kInt64, {N, 2}}, weights{w.data(), DType::kFP32, {N, 2}};
  const LowLatencyDispatchArgs dispatch{.x = TensorView(x.data(), DType::kBF16, {N, H}), .topk_idx = topk,
                                        .num_max_dispatch_tokens_per_rank = N, .num_experts = E, .use_fp8 = false};
  const Tensor y = Tensor::zeros({E / R, std::int64_t{R} * N, H}, DType::kBF16);
  static BufferConfig config() {
    return {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(N, H, R, E), .low_latency_mode = true};
  }
};

TEST(LowLatencyStats, ShapeAndDtypeAreChecked) {
  LocalWorld(2).run([&](Group& g) {
    const TinyCall call;
    constexpr int R = TinyCall::R;
    Buffer b(g, TinyCall::config());
    for (const Tensor& wrong : {Tensor::zeros({R}, DType::kInt32), Tensor::zeros({R + 1}, DType::kInt64),
                                Tensor::zeros({R, R}, DType::kInt64)}) {
      LowLatencyDispatchArgs a = call.dispatch;
      a.dispatch_wait_recv_cost_stats = wrong;
      const Caught c = catch_error([&] { b.low_latency_dispatch(a); });
      EXPECT_EQ(c.type, "InvalidArgument") << wrong.describe();
      EXPECT_NE(c.message.find("dispatch_wait_recv_cost_stats"), std::string::npos) << c.message;
    }
    LowLatencyDispatchResult d = b.low_latency_dispatch(call.dispatch);
    for (const Tensor& wrong : {Tensor::zeros({R}, DType::kFP32), Tensor::zeros({R - 1}, DType::kInt64)}) {
      const Caught c = catch_error([&] {
        b.low_latency_combine({.x = call.y, .topk_idx = call.topk, .topk_weights = call.weights, .handle = d.handle,
                               .combine_wait_recv_cost_stats = wrong});
      });
      EXPECT_EQ(c.type, "InvalidArgument") << wrong.describe();
      EXPECT_NE(c.message.find("combine_wait_recv_cost_stats"), std::string::npos) << c.message;
    }
  });
}

// ---- use_logfmt ----------------------------------------------------------------------------------

// Every rank's inputs of a case, and this rank's with their views.
TEST(LowLatencyCombine, LogFmtWithZeroCopyIsRejectedAndTheBufferStaysUsable) {
  for (int scaleout : {1, 2}) {
    const CaseSpec s = ll_spec(4, scaleout, 8, 3, 4, 256, 70 + scaleout);
    const auto failures = collect_on_ranks(4, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      const int me = g.rank(), N = s.max_tokens;
      Buffer b(g, {.num_rdma_bytes = low_latency_rdma_bytes(s), .low_latency_mode = true, .num_cpu_timeout_secs = 60});
      RankCall call(s, me);
      const auto expected = reference::low_latency_combine_reference(s, call.in, me);
      auto combine_checked = [&](const std::shared_ptr<LowLatencyHandle>& handle, const char* what) {
        const Tensor y = reference::slab_expert_outputs(s, call.all, me, std::int64_t{s.ranks} * N);
        const LowLatencyCombineResult c = b.low_latency_combine({.x = y, .topk_idx = call.topk, .topk_weights = call.weights, .handle = handle});
        if (call.n > 0 && std::memcmp(c.combined_x.data(), expected.data(), expected.size() * 2) != 0)
          bad.push_back(fmt::format("{}: combined_x differs from the reference", what));
      };
      for (int asking : {-1, 2}) {  // every rank asks; only rank 2 asks
        LowLatencyDispatchResult d = b.low_latency_dispatch({.x = call.x, .topk_idx = call.topk, .num_max_dispatch_tokens_per_rank = N,
                                                             .num_experts = s.num_experts, .use_fp8 = false});
        const Tensor y = reference::slab_expert_outputs(s, call.all, me, std::int64_t{s.ranks} * N);
        const bool asks = asking < 0 || asking == me;
        const Caught c = catch_error([&] {
          b.low_latency_combine({.x = y, .topk_idx = call.topk, .topk_weights = call.weights, .handle = d.handle, .use_logfmt = asks, .zero_copy = asks});
        });
        if (asks) {
          if (c.type != "InvalidArgument" || c.message.find("use_logfmt") == std::string::npos)
            bad.push_back(fmt::format("use_logfmt with zero_copy: {}: {}", c.type, c.message));
        } else if (c.type != "PeerError" || c.ranks != std::vector<int>{asking} || c.message.find("use_logfmt") == std::string::npos) {
          bad.push_back(fmt::format("a peer's use_logfmt: {}: {}", c.type, c.message));
        }
        // The rejected call changed nothing: the dispatch's handle still combines, then a new round works.
        combine_checked(d.handle, "combine after the rejected one");
        LowLatencyDispatchResult again = b.low_latency_dispatch({.x = call.x, .topk_idx = call.topk, .num_max_dispatch_tokens_per_rank = N,
                                                                 .num_experts = s.num_experts, .use_fp8 = false});
        combine_checked(again.handle, "next round");
      }
    });
    report(failures, fmt::format("{} nodes", scaleout));
  }
}

// ---- the signalled combine (hybrid-ep's overlap / src_signals) ------------------------------------

// A thread writes each local expert's rows into y, then raises its signal; the combine, started
// while y is still zero, must hand the rows over only after the signals and match the reference.
TEST(LowLatencyCombine, SignalledCombineWaitsForEachExpertsSignal) {
  for (int scaleout : {1, 2}) {
    const CaseSpec s = ll_spec(4, scaleout, 8, 3, 4, 256, 80 + scaleout);
    const auto failures = collect_on_ranks(4, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      const int me = g.rank(), N = s.max_tokens, El = s.num_experts / s.ranks;
      Buffer b(g, {.num_rdma_bytes = low_latency_rdma_bytes(s), .low_latency_mode = true, .num_cpu_timeout_secs = 60});
      RankCall call(s, me);
      LowLatencyDispatchResult d = b.low_latency_dispatch({.x = call.x, .topk_idx = call.topk, .num_max_dispatch_tokens_per_rank = N,
                                                           .num_experts = s.num_experts, .use_fp8 = false});
      const Tensor rows = reference::slab_expert_outputs(s, call.all, me, std::int64_t{s.ranks} * N);
      Tensor y = Tensor::zeros({El, std::int64_t{s.ranks} * N, s.hidden}, DType::kBF16);
      Tensor signals = Tensor::zeros({El}, DType::kInt32);
      const std::uint32_t expect = 0xfffffff0u;  // above INT32_MAX: compared unsigned
      std::thread producer([&] {
        const std::size_t expert_bytes = static_cast<std::size_t>(y.stride(0)) * 2;
        for (int e = 0; e < El; ++e) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          std::memcpy(static_cast<std::byte*>(y.data()) + e * expert_bytes,
                      static_cast<const std::byte*>(rows.data()) + e * expert_bytes, expert_bytes);
          std::atomic_ref<std::uint32_t>(signals.data_as<std::uint32_t>()[e]).store(expect, std::memory_order_release);
        }
      });
      const Caught c = catch_error([&] {
        const LowLatencyCombineResult r = b.low_latency_combine({.x = y, .topk_idx = call.topk, .topk_weights = call.weights,
                                                                 .handle = d.handle, .overlap = true,
                                                                 .src_signals = signals, .src_signal_expect_value = expect});
        const auto expected = reference::low_latency_combine_reference(s, call.in, me);
        if (call.n > 0 && std::memcmp(r.combined_x.data(), expected.data(), expected.size() * 2) != 0)
          bad.push_back("the signalled combine differs from the reference");
      });
      producer.join();
      if (!c.type.empty()) bad.push_back(fmt::format("{}: {}", c.type, c.message));
      for (int e = 0; e < El; ++e)  // only read
        if (signals.data_as<std::uint32_t>()[e] != expect) bad.push_back(fmt::format("src_signals[{}] changed", e));
    });
    report(failures, fmt::format("{} nodes", scaleout));
  }
}

TEST(LowLatencyCombine, SignalArgumentsAreChecked) {
  LocalWorld(2).run([&](Group& g) {
    const TinyCall call;
    constexpr int El = TinyCall::E / TinyCall::R;
    Buffer b(g, TinyCall::config());
    struct Wrong {
      bool overlap;
      Tensor signals;
      std::int64_t expect;
      const char* words;
    };
    for (const Wrong& wrong : {Wrong{true, Tensor(), 0, "overlap = true needs src_signals"},
                               Wrong{false, Tensor::zeros({El + 1}, DType::kInt32), 0, "src_signals"},
                               Wrong{false, Tensor::zeros({El}, DType::kInt64), 0, "src_signals"},
                               Wrong{false, Tensor::zeros({El}, DType::kInt32), -1, "src_signal_expect_value = -1"},
                               Wrong{false, Tensor::zeros({El}, DType::kInt32), std::int64_t{1} << 32,
                                     "src_signal_expect_value = 4294967296 is outside [0, 4294967295]"}}) {
      // each call (rejected ones too) takes one of the two slots: a fresh dispatch each time
      LowLatencyCombineArgs a{.x = call.y, .topk_idx = call.topk, .topk_weights = call.weights,
                              .handle = b.low_latency_dispatch(call.dispatch).handle};
      a.overlap = wrong.overlap;
      a.src_signals = wrong.signals;
      a.src_signal_expect_value = wrong.expect;
      const Caught c = catch_error([&] { b.low_latency_combine(a); });
      EXPECT_EQ(c.type, "InvalidArgument") << wrong.words;
      EXPECT_NE(c.message.find(wrong.words), std::string::npos) << c.message;
    }
  });
}

// ---- shrink mode --------------------------------------------------------------------------------

// Every rank masks the last rank (DeepEP's simulated failure): the slab and the combine match the
// reference of the inputs without the lanes that pair the last rank with another (either side).
TEST(LowLatencyShrink, EveryRankMaskingOneLeavesItsPairsOut) {
  for (int scaleout : {1, 2}) {
    const CaseSpec s = ll_spec(4, scaleout, 8, 3, 4, 256, 90 + scaleout);
    const int failed = s.ranks - 1, El = s.num_experts / s.ranks;
    std::vector<RankInputs> kept = reference::make_all_inputs(s);  // the reference's inputs
    for (int r = 0; r < s.ranks; ++r)
      for (std::int64_t& id : kept[static_cast<size_t>(r)].topk)
        if (id >= 0 && (r == failed || id / El == failed)) id = -1;
    const auto failures = collect_on_ranks(4, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      const int me = g.rank(), N = s.max_tokens;
      Buffer b(g, {.num_rdma_bytes = low_latency_rdma_bytes(s), .low_latency_mode = true, .enable_shrink = true,
                   .num_cpu_timeout_secs = 60});
      b.low_latency_update_mask_buffer(failed, true);
      RankCall call(s, me);
      LowLatencyDispatchResult d = b.low_latency_dispatch({.x = call.x, .topk_idx = call.topk,
                                                           .num_max_dispatch_tokens_per_rank = N,
                                                           .num_experts = s.num_experts, .use_fp8 = false});
      reference::check_slab(s, {.rows_per_expert = std::int64_t{s.ranks} * N}, kept, me, d.recv_x, d.recv_x_scales,
                            d.packed_recv_count, bad);
      const Tensor y = reference::slab_expert_outputs(s, kept, me, std::int64_t{s.ranks} * N);
      const LowLatencyCombineResult c = b.low_latency_combine({.x = y, .topk_idx = call.topk,
                                                               .topk_weights = call.weights, .handle = d.handle});
      const auto expected = reference::low_latency_combine_reference(s, kept[static_cast<size_t>(me)], me);
      if (call.n > 0 && std::memcmp(c.combined_x.data(), expected.data(), expected.size() * 2) != 0)
        bad.push_back("combined_x differs from the reference without the masked pairs");
      Tensor status = Tensor::zeros({s.ranks}, DType::kInt32);
      b.low_latency_query_mask_buffer(status);
      for (int r = 0; r < s.ranks; ++r)  // the failed rank learned that every rank masked it
        if (status.data_as<std::int32_t>()[r] != (r == failed || me == failed ? 1 : 0))
          bad.push_back(fmt::format("mask[{}] = {}", r, status.data_as<std::int32_t>()[r]));
    });
    report(failures, fmt::format("{} nodes", scaleout));
  }
}

}  // namespace legacy_low_latency_options_test
}  // namespace moe_ep
