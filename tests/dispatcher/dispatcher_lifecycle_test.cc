// Buffer lifecycle: layers with equal keys share one buffer, every key field rebuilds it, a
// constructor that fails publishes nothing, destroy and rebuild, the handle released after a
// failed combine; and the stage machine, the one-handle-per-micro-batch guard, two interleaved
// micro-batches, hooks between the halves, zero-token ranks and validation before the buffer.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cstring>

#include "support/dispatcher_fixture.hh"
#include "support/text.hh"

namespace moe_ep::testing {
namespace dispatcher_lifecycle_test {

constexpr int kRanks = 4, kHidden = 256, kExperts = 8, kTopk = 2, kCap = 6;

DispatcherOptions options(bool v2, DispatchMode mode = DispatchMode::kAuto) {
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.num_topk = kTopk;
  o.use_v2 = v2;
  o.mode = mode;
  o.num_max_dispatch_tokens_per_rank = kCap;
  o.num_max_prefill_tokens_per_rank = 2 * kCap;
  o.timeout_secs = 30;
  o.provider_path = "cpu";
  return o;
}

// A batch of `s` through `d`, verified (fixture's run_batch); problems go to `bad`.
void round_trip(Group& g, TokenDispatcher& d, const CaseSpec& s, BatchKind kind, std::vector<std::string>& bad,
                int micro_batch = 0) {
  run_batch(g, d, s, kind, bad, "round trip", micro_batch);
}

TEST(Lifecycle, EqualKeysShareOneBufferAndEveryKeyFieldRebuilds) {
  for (bool v2 : {false, true}) {
    run_ranks(kRanks, {}, [&](Group& g, std::vector<std::string>& bad) {
      BufferCache cache(g);
      const CaseSpec s = make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 7);
      TokenDispatcher layer0(cache, options(v2)), layer1(cache, options(v2));
      round_trip(g, layer0, s, BatchKind::kPrefill, bad);
      round_trip(g, layer1, s, BatchKind::kPrefill, bad);
      round_trip(g, layer0, s, BatchKind::kDecode, bad);
      BufferCacheStats st = cache.stats();
      if (st.builds != 1 || st.reuses != 2 || st.destroys != 0)
        bad.push_back(fmt::format("shared: builds {} reuses {} destroys {}", st.builds, st.reuses, st.destroys));
      if (st.buffer_bytes <= 0) bad.push_back("buffer size not reported");
      // Each field of the key, changed alone, rebuilds (and the old buffer is destroyed).
      std::vector<std::function<void(DispatcherOptions&)>> changes = {
          [](DispatcherOptions& o) { o.hidden = 384; },
          [](DispatcherOptions& o) { o.num_topk = 3; },
          [](DispatcherOptions& o) { o.num_max_dispatch_tokens_per_rank = kCap + 1; },
          [](DispatcherOptions& o) { o.num_max_prefill_tokens_per_rank = 3 * kCap; },
          [](DispatcherOptions& o) { o.dispatch_dtype = WireDType::kFP8; },
          [](DispatcherOptions& o) { o.timeout_secs = 31; },
      };
      if (v2) {
        changes.push_back([](DispatcherOptions& o) { o.allow_hybrid_mode = false; });
        changes.push_back([](DispatcherOptions& o) { o.allow_multiple_reduction = false; });
      } else {
        changes.push_back([](DispatcherOptions& o) { o.num_experts = 2 * kExperts; });
        changes.push_back([](DispatcherOptions& o) { o.mode = DispatchMode::kNormal; });  // no low-latency pool
      }
      int expected_builds = 1;
      for (std::size_t i = 0; i < changes.size(); ++i) {
        DispatcherOptions o = options(v2);
        changes[i](o);
        TokenDispatcher changed(cache, o);
        CaseSpec cs = make_spec(kRanks, 1, o.num_experts, o.num_topk, kCap, o.hidden, 8 + i);
        round_trip(g, changed, cs, BatchKind::kPrefill, bad);
        round_trip(g, layer0, s, BatchKind::kPrefill, bad);  // and back
        expected_builds += 2;
        st = cache.stats();
        if (st.builds != expected_builds || st.destroys != expected_builds - 1)
          bad.push_back(fmt::format("change {}: builds {} destroys {}", i, st.builds, st.destroys));
      }
      cache.destroy();
      if (cache.stats().buffer_bytes != 0 || cache.stats().current_generation) bad.push_back("destroy left a buffer");
      round_trip(g, layer0, s, BatchKind::kDecode, bad);  // builds again
      if (cache.stats().builds != expected_builds + 1) bad.push_back("no rebuild after destroy");
    });
  }
}

TEST(Lifecycle, FailedConstructorPublishesNothing) {
  // The test provider's V2 constructor fails for hidden = 384 on every rank.
  run_ranks(kRanks, {}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    DispatcherOptions good = options(true), failing = options(true);
    good.provider_path = failing.provider_path = MOE_EP_TEST_provider_both;
    failing.hidden = 384;
    const CaseSpec s = make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 9);
    TokenDispatcher d(cache, good);
    round_trip(g, d, s, BatchKind::kPrefill, bad);
    TokenDispatcher broken(cache, failing);
    const CaseSpec s384 = make_spec(kRanks, 1, kExperts, kTopk, kCap, 384, 9);
    const Inputs in = to_tensors(s384, reference::make_inputs(s384, g.rank()));
    const Caught c = catch_error([&] { broken.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill); });
    if (c.type != "CapacityError" || !contains(c.message, "cannot allocate")) bad.push_back(c.type + ": " + c.message);
    BufferCacheStats st = cache.stats();
    if (st.current_generation || st.buffer_bytes != 0 || st.builds != 1)
      bad.push_back(fmt::format("a failed constructor left state: builds {} bytes {}", st.builds, st.buffer_bytes));
    round_trip(g, d, s, BatchKind::kPrefill, bad);  // the good key builds again
    if (cache.stats().builds != 2) bad.push_back("no rebuild after the failure");
  });
}

TEST(Lifecycle, HandleIsReleasedWhenCombineFails) {
  for (bool v2 : {false, true}) {
    run_ranks(kRanks, {}, [&](Group& g, std::vector<std::string>& bad) {
      BufferCache cache(g);
      TokenDispatcher d(cache, options(v2));
      const CaseSpec s = make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 10);
      for (BatchKind kind : {BatchKind::kPrefill, BatchKind::kDecode}) {
        const Inputs in = to_tensors(s, reference::make_inputs(s, g.rank()));
        const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, kind);
        // Rank 3 passes an expert output of the wrong shape: it raises the shape error, the
        // others PeerError naming it; every slot is free again afterwards.
        std::vector<std::int64_t> dims(out.hidden_states.shape().begin(), out.hidden_states.shape().end());
        if (g.rank() == 3) ++dims.back();
        const Tensor y = Tensor::zeros(std::span<const std::int64_t>(dims), DType::kBF16);
        const Caught c = catch_error([&] { d.combine(y); });
        if (g.rank() == 3 ? c.type != "InvalidArgument" : (c.type != "PeerError" || c.ranks != std::vector<int>{3}))
          bad.push_back(c.type + ": " + c.message);
        if (g.rank() == 3 && !contains(c.message, "expert_output")) bad.push_back("the argument is not named: " + c.message);
        round_trip(g, d, s, kind, bad);
      }
    });
  }
}

TEST(Stages, OutOfOrderCallsAndTheHandleGuard) {
  run_ranks(2, {}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    TokenDispatcher d(cache, options(true));
    const CaseSpec s = make_spec(2, 1, kExperts, kTopk, kCap, kHidden, 11);
    const Inputs in = to_tensors(s, reference::make_inputs(s, g.rank()));
    auto expect = [&](const Caught& c, const std::string& type, const std::string& part) {
      if (c.type != type || !contains(c.message, part)) bad.push_back(fmt::format("want {} '{}', got {}: {}", type, part, c.type, c.message));
    };
    expect(catch_error([&] { d.dispatch_b(); }), "StateError", "dispatch_b called out of order: micro-batch 0 is idle; the next call must be dispatch_a");
    expect(catch_error([&] { d.combine(Tensor::zeros({1, kHidden}, DType::kBF16)); }), "StateError", "combine_a called out of order");
    expect(catch_error([&] { d.combine_b(1); }), "StateError", "micro-batch 1 is idle");
    expect(catch_error([&] { d.dispatch_b(2); }), "InvalidArgument", "micro_batch = 2 is out of range: expected 0 to 1");
    d.dispatch_a(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill);
    expect(catch_error([&] { d.dispatch_a(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill); }), "StateError",
           "the next call must be dispatch_b");
    expect(catch_error([&] { d.combine_a(Tensor()); }), "StateError", "between dispatch_a and dispatch_b");
    const DispatchOutput out = d.dispatch_b();
    expect(catch_error([&] { d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill); }), "StateError",
           "still holds the handle of its previous dispatch: combine it first");
    expect(catch_error([&] { cache.destroy(); }), "StateError", "still hold handles");
    d.combine_a(Tensor::zeros({out.hidden_states.size(0), kHidden}, DType::kBF16));
    expect(catch_error([&] { d.combine_a(Tensor()); }), "StateError", "the next call must be combine_b");
    d.combine_b();
    round_trip(g, d, s, BatchKind::kDecode, bad);  // everything works again
  });
}

TEST(Stages, TwoMicroBatchesInterleavedAndHooksBetweenTheHalves) {
  for (bool v2 : {false, true}) {
    run_ranks(kRanks, {}, [&](Group& g, std::vector<std::string>& bad) {
      BufferCache cache(g);
      TokenDispatcher d(cache, options(v2));
      std::vector<std::string> events;
      d.add_hook(HookPoint::kAfterDispatchA, [&](const HookInfo& h) {
        events.push_back(fmt::format("dispatch {} {}", h.micro_batch, mode_name(h.mode)));
      });
      d.add_hook(HookPoint::kAfterCombineA, [&](const HookInfo& h) { events.push_back(fmt::format("combine {}", h.micro_batch)); });
      for (BatchKind kind : {BatchKind::kDecode, BatchKind::kPrefill}) {
        CaseSpec specs[2] = {make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 20),
                             make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 21)};
        std::vector<RankInputs> all[2];
        Inputs in[2];
        for (int m = 0; m < 2; ++m) {
          for (int r = 0; r < kRanks; ++r) all[m].push_back(reference::make_inputs(specs[m], r));
          in[m] = to_tensors(specs[m], all[m][static_cast<size_t>(g.rank())]);
        }
        // a0 a1 b0 b1, then the combines in dispatch order (V1 low-latency has two buffer slots
        // that alternate per call: a later call may not reuse the slot of a pending dispatch).
        d.dispatch_a(in[0].x, in[0].topk_idx, in[0].topk_weights, kind, 0);
        d.dispatch_a(in[1].x, in[1].topk_idx, in[1].topk_weights, kind, 1);
        DispatchOutput out[2] = {d.dispatch_b(0), d.dispatch_b(1)};
        for (int m : {0, 1}) {
          check_dispatch(specs[m], {}, all[m], g.rank(), out[m], bad);
          const Tensor y = d.combine(expert_outputs(specs[m], {}, all[m], g.rank(), out[m]), m);
          check_combined(expected_combine(specs[m], {}, all[m], g.rank(), out[m]), y, fmt::format("micro-batch {}", m), bad);
        }
      }
      const CaseSpec s = make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 22);
      round_trip(g, d, s, BatchKind::kDecode, bad);
      const std::vector<std::string> want = {"combine 0", "combine 1", "combine 0", "combine 1",
                                             "dispatch 0 low_latency", "combine 0"};
      if (events != want) bad.push_back(fmt::format("hook events: {}", fmt::join(events, ", ")));
    });
  }
}

TEST(Validation, ZeroTokenRanksTakePartInEveryMode) {
  for (bool v2 : {false, true}) {
    for (bool fp8 : {false, true}) {
      run_ranks(kRanks, {.num_scaleout = 2}, [&](Group& g, std::vector<std::string>& bad) {
        BufferCache cache(g);
        DispatcherOptions o = options(v2);
        o.dispatch_dtype = fp8 ? WireDType::kFP8 : WireDType::kBF16;
        TokenDispatcher d(cache, o);
        // Ranks 1 and 2 have no tokens; then every rank has none.
        const CaseSpec some = make_spec(kRanks, 2, kExperts, kTopk, kCap, kHidden, 30, [](int r) { return r == 1 || r == 2 ? 0 : kCap; });
        const CaseSpec none = make_spec(kRanks, 2, kExperts, kTopk, kCap, kHidden, 31, [](int) { return 0; });
        for (BatchKind kind : {BatchKind::kPrefill, BatchKind::kDecode}) {
          round_trip(g, d, some, kind, bad);
          round_trip(g, d, none, kind, bad);
        }
      });
    }
  }
}

TEST(Validation, BadBatchesAreRejectedBeforeTheBufferAndNamedOnEveryRank) {
  run_ranks(kRanks, {}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    TokenDispatcher d(cache, options(true));
    const CaseSpec s = make_spec(kRanks, 1, kExperts, kTopk, 2 * kCap, kHidden, 40, [](int) { return kCap + 1; });
    const Inputs in = to_tensors(s, reference::make_inputs(s, g.rank()));
    const Inputs ok = to_tensors(s, reference::make_inputs(make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 41), g.rank()));
    struct Case {
      std::function<void()> call;
      std::string message;
    };
    Tensor bad_ids = Tensor::empty({ok.topk_idx.size(0), kTopk}, DType::kInt64);
    std::memcpy(bad_ids.data(), ok.topk_idx.data(), ok.topk_idx.nbytes());
    if (bad_ids.numel() > 0) bad_ids.data_as<std::int64_t>()[0] = kExperts;
    Tensor dup_ids = Tensor::empty({ok.topk_idx.size(0), kTopk}, DType::kInt64);
    std::memcpy(dup_ids.data(), ok.topk_idx.data(), ok.topk_idx.nbytes());
    if (dup_ids.numel() > 0) dup_ids.data_as<std::int64_t>()[1] = dup_ids.data_as<std::int64_t>()[0] = 3;
    const std::vector<Case> cases = {
        {[&] { d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kDecode); },
         "7 tokens exceed the low_latency token cap of MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK = 6; raise MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"},
        {[&] { d.dispatch(Tensor::zeros({2, kHidden + 1}, DType::kBF16), ok.topk_idx, ok.topk_weights, BatchKind::kPrefill); },
         "x has size 257 in dimension 1, expected 256"},
        {[&] { d.dispatch(ok.x, Tensor::zeros({ok.x.size(0), kTopk + 1}, DType::kInt64), ok.topk_weights, BatchKind::kPrefill); },
         "topk_idx has size 3 in dimension 1, expected 2"},
        {[&] { d.dispatch(ok.x, bad_ids, ok.topk_weights, BatchKind::kPrefill); }, "topk_idx[0, 0] = 8"},
        {[&] { d.dispatch(ok.x, dup_ids, ok.topk_weights, BatchKind::kPrefill); }, "twice"},
        {[&] { d.dispatch(ok.x, ok.topk_idx, Tensor::zeros({ok.x.size(0), kTopk}, DType::kBF16), BatchKind::kPrefill); },
         "topk_weights"},
    };
    for (std::size_t i = 0; i < cases.size(); ++i) {
      // Only rank 2 makes the mistake (the first case: every rank does).
      const bool culprit = i == 0 || g.rank() == 2;
      const Caught c = catch_error([&] {
        if (culprit) {
          cases[i].call();
        } else {
          d.dispatch(ok.x, ok.topk_idx, ok.topk_weights, i == 0 ? BatchKind::kDecode : BatchKind::kPrefill);
        }
      });
      if (culprit ? (c.type != "InvalidArgument" || !contains(c.message, cases[i].message))
                  : (c.type != "PeerError" || c.ranks != std::vector<int>{2} || !contains(c.message, cases[i].message)))
        bad.push_back(fmt::format("case {}: {}: {}", i, c.type, c.message));
    }
    if (cache.stats().builds != 0) bad.push_back("the buffer was built for rejected batches");
    // Ranks that resolve different modes for one batch are named.
    const Caught m = catch_error([&] {
      d.dispatch(ok.x, ok.topk_idx, ok.topk_weights, g.rank() == 0 ? BatchKind::kPrefill : BatchKind::kDecode);
    });
    if (m.type != "PeerError" || !contains(m.message, "ranks disagree on mode")) bad.push_back("modes: " + m.type + ": " + m.message);
    round_trip(g, d, make_spec(kRanks, 1, kExperts, kTopk, kCap, kHidden, 42), BatchKind::kDecode, bad);
  });
}

}  // namespace dispatcher_lifecycle_test
}  // namespace moe_ep::testing
