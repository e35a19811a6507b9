// Several threads of each rank calling token dispatchers on that rank's one BufferCache at once
// (docs/semantics.md, "Concurrent calls"): threads 0 and 1 share one TokenDispatcher (micro-batches
// 0 and 1), thread 2 has one of its own; the cache serialises every call. Threads that take turns in
// the same order on every rank get the references' results for inputs of their own, on both
// generations and in both modes; free-running threads get the references' results or the
// PeerError of ranks that disagree, and the cache stays usable.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "support/dispatcher_fixture.hh"
#include "support/rank_threads.hh"

namespace moe_ep::testing {
namespace dispatcher_concurrent_calls_test {

constexpr int kThreads = 3, kHidden = 128, kExperts = 8, kTopk = 3, kCap = 6;

DispatcherOptions options(bool v2) {
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.num_topk = kTopk;
  o.use_v2 = v2;
  o.mode = DispatchMode::kAuto;  // prefill batches in normal mode, decode batches in low-latency mode
  o.num_max_dispatch_tokens_per_rank = kCap;
  o.num_max_prefill_tokens_per_rank = kCap;
  o.num_workers = 1;
  o.timeout_secs = 120;
  o.provider_path = "cpu";
  return o;
}

CaseSpec spec_of(std::uint64_t seed) { return make_spec(4, 1, kExperts, kTopk, kCap, kHidden, seed); }

// Thread t's dispatcher and micro-batch: threads 0 and 1 share dispatcher 0.
struct Layers {
  Layers(BufferCache& cache, bool v2) {
    for (int i = 0; i < 2; ++i) dispatchers.push_back(std::make_unique<TokenDispatcher>(cache, options(v2)));
  }
  TokenDispatcher& of(int thread) { return *dispatchers[static_cast<size_t>(thread / 2)]; }
  static int micro_batch(int thread) { return thread % 2; }
  std::vector<std::unique_ptr<TokenDispatcher>> dispatchers;
};

TEST(DispatcherConcurrentCalls, ThreadsTakingTurnsGetTheReferenceOnBothGenerationsAndModes) {
  for (bool v2 : {false, true}) {
    run_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
      BufferCache cache(g);
      Layers layers(cache, v2);
      bad = run_rank_threads(kThreads, 16, true, [&](int t, int round, std::vector<std::string>& problems) {
        const BatchKind kind = round % 2 == 0 ? BatchKind::kPrefill : BatchKind::kDecode;
        run_batch(g, layers.of(t), spec_of(80 + t), kind, problems, fmt::format("V{} thread {} round {}", v2 ? 2 : 1, t, round),
                  Layers::micro_batch(t));
      });
    });
  }
}

// One thread's calls: a dispatch checked against the reference, then the combine of its batch.
class Batches {
 public:
  Batches(const CaseSpec& s, int rank) : s_(s), me_(rank), all_(reference::make_all_inputs(s)), in_(to_tensors(s, all_[rank])) {}
  DispatchOutput dispatch(TokenDispatcher& d, BatchKind kind, int micro_batch, std::vector<std::string>& bad) {
    DispatchOutput out = d.dispatch(in_.x, in_.topk_idx, in_.topk_weights, kind, micro_batch);
    check_dispatch(s_, expectation(d.options()), all_, me_, out, bad);
    return out;
  }
  void combine(TokenDispatcher& d, const DispatchOutput& out, std::vector<std::string>& bad) {
    const Expectation e = expectation(d.options());
    const Tensor combined = d.combine(expert_outputs(s_, e, all_, me_, out), out.micro_batch);
    check_combined(expected_combine(s_, e, all_, me_, out), combined, "combined", bad);
  }

 private:
  CaseSpec s_;
  int me_;
  std::vector<RankInputs> all_;
  Inputs in_;
};

struct FreeCase {
  bool v2;
  BatchKind kind;
};

// Free-running threads alternate a dispatch and the combine of their batch: ranks that pair
// different calls (a dispatch with a combine, other micro-batches, or combines of different
// dispatches) raise PeerError on every rank; every other call matches the reference.
TEST(DispatcherConcurrentCalls, FreeRunningThreadsGetTheReferenceOrADisagreement) {
  for (const FreeCase c : {FreeCase{false, BatchKind::kPrefill}, FreeCase{true, BatchKind::kPrefill},
                           FreeCase{true, BatchKind::kDecode}}) {
    run_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
      BufferCache cache(g);
      Layers layers(cache, c.v2);
      std::vector<std::unique_ptr<Batches>> batches;
      for (int t = 0; t < kThreads; ++t) batches.push_back(std::make_unique<Batches>(spec_of(90), g.rank()));
      std::vector<std::optional<DispatchOutput>> held(kThreads);
      bad = run_rank_threads(kThreads, 80, false, [&](int t, int, std::vector<std::string>& problems) {
        Batches& mine = *batches[static_cast<size_t>(t)];
        std::optional<DispatchOutput>& out = held[static_cast<size_t>(t)];
        const Caught caught = catch_error([&] {
          if (out) {
            const DispatchOutput o = *std::exchange(out, std::nullopt);
            mine.combine(layers.of(t), o, problems);
          } else {
            out = mine.dispatch(layers.of(t), c.kind, Layers::micro_batch(t), problems);
          }
        });
        if (!caught.type.empty() && !ranks_disagreed(caught))
          problems.push_back(fmt::format("V{} {}: {}: {}", c.v2 ? 2 : 1, batch_kind_name(c.kind), caught.type, caught.message));
      });
      // A thread may still hold its last dispatch (on some ranks only): a new layer on the cache.
      TokenDispatcher last(cache, options(c.v2));
      batches[0]->combine(last, batches[0]->dispatch(last, c.kind, 0, bad), bad);
    });
  }
}

}  // namespace dispatcher_concurrent_calls_test
}  // namespace moe_ep::testing
