// Several threads of each rank calling that rank's one V1 Buffer at once (docs/semantics.md,
// "Concurrent calls"), in normal and low-latency mode, with receive hooks called from yet another
// thread: the buffer serialises the calls and the hooks. Threads that take turns in the same order
// on every rank make matching calls with inputs of their own and get the references' results;
// free-running threads get the references' results or the documented refusals (ranks that
// disagree; in low-latency mode a slot still in use), and the buffer stays usable.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "moe_ep/legacy_buffer.hpp"
#include "reference/dense_reference.hh"
#include "reference/low_latency_reference.hh"
#include "support/legacy_harness.hh"
#include "support/rank_runner.hh"
#include "support/rank_threads.hh"

namespace moe_ep {
namespace legacy_concurrent_calls_test {

using reference::CaseSpec;
using reference::RankInputs;
using testing::Caught;
using testing::LegacyCalls;
using testing::LegacyRunOptions;

constexpr int kThreads = 3;

CaseSpec normal_case(int scaleout, std::uint64_t seed) {
  CaseSpec s;
  s.ranks = 4;
  s.scaleout = scaleout;
  s.num_experts = 8;
  s.k = 3;
  s.max_tokens = 6;
  s.hidden = 64;
  s.num_bias = 1;
  s.seed = seed;
  s.tokens = {6, 3, 0, 5};
  return s;
}

// Thread 1 finishes its calls asynchronously and waits for their events.
LegacyRunOptions normal_options(int thread) { return {.cached = false, .async = thread == 1, .num_sms = 2}; }

std::unique_ptr<Buffer> normal_buffer(Group& g) {
  return std::make_unique<Buffer>(g, BufferConfig{.num_rdma_bytes = 4 << 20, .num_cpu_timeout_secs = 120});
}

TEST(LegacyConcurrentCalls, NormalModeThreadsTakingTurnsDispatchAndCombineTheirOwnInputs) {
  for (int scaleout : {1, 2}) {
    testing::report_problems(testing::collect_on_ranks(4, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      auto buffer = normal_buffer(g);
      std::vector<std::unique_ptr<LegacyCalls>> calls;
      for (int t = 0; t < kThreads; ++t)
        calls.push_back(std::make_unique<LegacyCalls>(normal_case(scaleout, 40 + t), normal_options(t), g.rank()));
      bad = testing::run_rank_threads(kThreads, 25, true, [&](int t, int, std::vector<std::string>& problems) {
        LegacyCalls& mine = *calls[static_cast<size_t>(t)];
        mine.combine(*buffer, mine.dispatch(*buffer, problems), problems);
      });
    }), {.context = fmt::format("{} node(s)", scaleout), .max_per_rank = 5});
  }
}

// Free-running threads alternate a dispatch and the combine of its handle: ranks that pair
// different calls raise PeerError on every rank, every other call matches the reference.
TEST(LegacyConcurrentCalls, NormalModeFreeRunningThreadsGetTheReferenceOrADisagreement) {
  const CaseSpec s = normal_case(1, 50);
  testing::report_problems(testing::collect_on_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    auto buffer = normal_buffer(g);
    std::vector<std::unique_ptr<LegacyCalls>> calls;
    for (int t = 0; t < kThreads; ++t) calls.push_back(std::make_unique<LegacyCalls>(s, normal_options(t), g.rank()));
    std::vector<std::optional<LegacyCalls::Dispatched>> held(kThreads);
    bad = testing::run_rank_threads(kThreads, 120, false, [&](int t, int, std::vector<std::string>& problems) {
      LegacyCalls& mine = *calls[static_cast<size_t>(t)];
      std::optional<LegacyCalls::Dispatched>& handle = held[static_cast<size_t>(t)];
      const Caught c = testing::catch_error([&] {
        if (handle) {
          const LegacyCalls::Dispatched d = *std::exchange(handle, std::nullopt);
          mine.combine(*buffer, d, problems);
        } else {
          handle = mine.dispatch(*buffer, problems);
        }
      });
      if (!c.type.empty() && !testing::ranks_disagreed(c)) problems.push_back(fmt::format("{}: {}", c.type, c.message));
    });
    calls[0]->combine(*buffer, calls[0]->dispatch(*buffer, bad), bad);
  }), {.max_per_rank = 5});
}

// ---- low-latency mode ------------------------------------------------------------------------

// One thread's low-latency calls: a dispatch whose receive hook runs on another thread, checked
// against the slab reference, and the combine of its handle against the weighted reference.
class LowLatencyCalls {
 public:
  LowLatencyCalls(const CaseSpec& s, int rank) : s_(s), me_(rank), all_(reference::make_all_inputs(s)) {}

  LowLatencyDispatchResult dispatch(Buffer& b, std::vector<std::string>& bad) {
    RankInputs& in = all_[static_cast<size_t>(me_)];
    const std::int64_t n = in.num_tokens;
    LowLatencyDispatchResult d = b.low_latency_dispatch({.x = TensorView(in.x.data(), DType::kBF16, {n, s_.hidden}),
                                                         .topk_idx = TensorView(in.topk.data(), DType::kInt64, {n, s_.k}),
                                                         .num_max_dispatch_tokens_per_rank = s_.max_tokens,
                                                         .num_experts = s_.num_experts,
                                                         .use_fp8 = false,
                                                         .return_recv_hook = true});
    std::async(std::launch::async, [&] { d.hook(); }).get();  // the receive, from another thread
    reference::check_slab(s_, {.rows_per_expert = rows_per_expert()}, all_, me_, d.recv_x, d.recv_x_scales,
                          d.packed_recv_count, bad);
    return d;
  }

  void combine(Buffer& b, const LowLatencyDispatchResult& d, std::vector<std::string>& bad) {
    RankInputs& in = all_[static_cast<size_t>(me_)];
    const std::int64_t n = in.num_tokens;
    const Tensor y = reference::slab_expert_outputs(s_, all_, me_, rows_per_expert());
    const LowLatencyCombineResult r = b.low_latency_combine({.x = y,
                                                             .topk_idx = TensorView(in.topk.data(), DType::kInt64, {n, s_.k}),
                                                             .topk_weights = TensorView(in.weights.data(), DType::kFP32, {n, s_.k}),
                                                             .handle = d.handle});
    const std::vector<std::uint16_t> expected = reference::low_latency_combine_reference(s_, in, me_);
    if (n > 0 && std::memcmp(r.combined_x.data(), expected.data(), expected.size() * sizeof(std::uint16_t)) != 0)
      bad.push_back(fmt::format("[rank {}] low_latency_combine differs from the reference", me_));
  }

 private:
  std::int64_t rows_per_expert() const { return std::int64_t{s_.ranks} * s_.max_tokens; }
  CaseSpec s_;
  int me_;
  std::vector<RankInputs> all_;
};

CaseSpec low_latency_case(std::uint64_t seed) { return reference::low_latency_spec(4, 1, 8, 3, 6, 128, seed, 1.0); }

std::unique_ptr<Buffer> low_latency_buffer(Group& g, const CaseSpec& s) {
  return std::make_unique<Buffer>(g, BufferConfig{.num_rdma_bytes = testing::low_latency_rdma_bytes(s),
                                                  .low_latency_mode = true,
                                                  .num_cpu_timeout_secs = 120});
}

TEST(LegacyConcurrentCalls, LowLatencyThreadsTakingTurnsWithReceiveHooksOnAnotherThread) {
  testing::report_problems(testing::collect_on_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    auto buffer = low_latency_buffer(g, low_latency_case(60));
    std::vector<std::unique_ptr<LowLatencyCalls>> calls;
    for (int t = 0; t < kThreads; ++t) calls.push_back(std::make_unique<LowLatencyCalls>(low_latency_case(60 + t), g.rank()));
    bad = testing::run_rank_threads(kThreads, 25, true, [&](int t, int, std::vector<std::string>& problems) {
      LowLatencyCalls& mine = *calls[static_cast<size_t>(t)];
      mine.combine(*buffer, mine.dispatch(*buffer, problems), problems);
    });
  }), {.max_per_rank = 5});
}

// A refusal free-running low-latency threads may meet: ranks that disagree, or the slot rules
// (a slot still holding a result whose hook has not run, a handle or hook whose slot was used
// again), on the refusing rank and, through the agreement, on its peers.
bool low_latency_refusal(const Caught& c) {
  if (testing::ranks_disagreed(c)) return true;
  const bool typed = c.type == "PeerError" || c.type == "InvalidArgument" || c.type == "StateError";
  return typed && c.message.find("slot") != std::string::npos;
}

TEST(LegacyConcurrentCalls, LowLatencyFreeRunningThreadsGetTheReferenceOrARefusal) {
  const CaseSpec s = low_latency_case(70);
  testing::report_problems(testing::collect_on_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    auto buffer = low_latency_buffer(g, s);
    std::vector<std::unique_ptr<LowLatencyCalls>> calls;
    for (int t = 0; t < kThreads; ++t) calls.push_back(std::make_unique<LowLatencyCalls>(s, g.rank()));
    std::vector<std::optional<LowLatencyDispatchResult>> held(kThreads);
    bad = testing::run_rank_threads(kThreads, 120, false, [&](int t, int, std::vector<std::string>& problems) {
      LowLatencyCalls& mine = *calls[static_cast<size_t>(t)];
      std::optional<LowLatencyDispatchResult>& handle = held[static_cast<size_t>(t)];
      const Caught c = testing::catch_error([&] {
        if (handle) {
          const LowLatencyDispatchResult d = *std::exchange(handle, std::nullopt);
          mine.combine(*buffer, d, problems);
        } else {
          handle = mine.dispatch(*buffer, problems);
        }
      });
      if (!c.type.empty() && !low_latency_refusal(c)) problems.push_back(fmt::format("{}: {}", c.type, c.message));
    });
    // A slot may still be marked in use on some ranks (a refused call's): the clean resets both.
    buffer->clean_low_latency_buffer(s.max_tokens, s.hidden, s.num_experts);
    calls[0]->combine(*buffer, calls[0]->dispatch(*buffer, bad), bad);
  }), {.max_per_rank = 5});
}

}  // namespace legacy_concurrent_calls_test
}  // namespace moe_ep
