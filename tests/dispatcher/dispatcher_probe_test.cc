// The provider probe with real shared libraries built by the test suite: V1 only, V1 and V2,
// neither, an init failure, an ABI mismatch, an older entry symbol, no entry symbol, a missing
// file; search order along the path list; data through a loaded provider; and ranks that
// disagree (a generation missing on some ranks, different providers), which every rank reports
// by name.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>

#include "dispatcher/provider_registry.hh"
#include "support/dispatcher_fixture.hh"
#include "moe_ep/provider.hpp"
#include "support/text.hh"

namespace moe_ep::testing {
namespace {

const std::string kV1Only = MOE_EP_TEST_provider_v1_only;
const std::string kBoth = MOE_EP_TEST_provider_both;
const std::string kNone = MOE_EP_TEST_provider_none;
const std::string kInitFailure = MOE_EP_TEST_provider_init_failure;
const std::string kAbiMismatch = MOE_EP_TEST_provider_abi_mismatch;
const std::string kOldAbi = MOE_EP_TEST_provider_old_abi;
const std::string kNoSymbol = MOE_EP_TEST_provider_no_symbol;

TEST(Probe, BuiltinOffersBothGenerations) {
  const ProbeReport& p = probe_providers("");
  EXPECT_EQ(p.path_list, "cpu");
  EXPECT_TRUE(p.v1.available);
  EXPECT_TRUE(p.v2.available);
  EXPECT_EQ(p.v1.provider, "cpu");
  EXPECT_EQ(p.v2.origin, "builtin");
  EXPECT_EQ(&probe_providers(""), &p) << "each path list is probed once";
}

TEST(Probe, MatrixOfProviderLibraries) {
  {
    const ProbeReport& p = probe_providers(kV1Only);
    EXPECT_TRUE(p.v1.available);
    EXPECT_EQ(p.v1.provider, "test-v1");
    EXPECT_EQ(p.v1.origin, kV1Only);
    EXPECT_FALSE(p.v2.available);
    EXPECT_TRUE(contains(p.v2.reason, "provider 'test-v1'): offers V1 only")) << p.v2.reason;
  }
  {
    const ProbeReport& p = probe_providers(kBoth);
    EXPECT_TRUE(p.v1.available && p.v2.available);
    EXPECT_EQ(p.v2.provider, "test-both");
  }
  {
    const ProbeReport& p = probe_providers(kNone);
    EXPECT_FALSE(p.v1.available || p.v2.available);
    EXPECT_TRUE(contains(p.v1.reason, "offers neither V1 nor V2")) << p.v1.reason;
  }
  {
    const ProbeReport& p = probe_providers(kInitFailure);
    EXPECT_FALSE(p.v1.available || p.v2.available);
    EXPECT_TRUE(contains(p.v2.reason, "(provider 'test-init'): init failed: no accelerator found")) << p.v2.reason;
  }
  {
    const ProbeReport& p = probe_providers(kAbiMismatch);
    EXPECT_FALSE(p.v1.available || p.v2.available);
    EXPECT_TRUE(contains(p.v1.reason, "provider ABI mismatch: library built for ABI 99")) << p.v1.reason;
  }
  {
    const ProbeReport& p = probe_providers(kOldAbi);
    EXPECT_FALSE(p.v1.available);
    EXPECT_TRUE(contains(p.v1.reason, "missing symbol moe_ep_provider_abi_6 (it exports moe_ep_provider_abi_0: built for ABI 0)"))
        << p.v1.reason;
  }
  {
    const ProbeReport& p = probe_providers(kNoSymbol);
    EXPECT_FALSE(p.v1.available);
    EXPECT_TRUE(contains(p.v1.reason, "missing symbol moe_ep_provider_abi_6 (not a moe-ep provider)")) << p.v1.reason;
  }
  {
    const ProbeReport& p = probe_providers("/nonexistent/libmoe_ep_cuda.so");
    EXPECT_FALSE(p.v1.available || p.v2.available);
    EXPECT_TRUE(contains(p.v1.reason, "/nonexistent/libmoe_ep_cuda.so: cannot load library")) << p.v1.reason;
    ASSERT_EQ(p.providers.size(), 1u);
    EXPECT_FALSE(p.providers[0].error.empty());
  }
}

TEST(Probe, PathListIsSearchedInOrderAndReasonsAreJoined) {
  const ProbeReport& p = probe_providers("/nonexistent/a.so:" + kV1Only + ":cpu");
  EXPECT_EQ(p.v1.provider, "test-v1");  // the first that offers V1
  EXPECT_EQ(p.v2.provider, "cpu");      // test-v1 has no V2; the built-in comes next
  ASSERT_EQ(p.providers.size(), 3u);
  EXPECT_TRUE(p.providers[1].offers_v1 && !p.providers[1].offers_v2);
  const ProbeReport& none = probe_providers(kNone + ":" + kInitFailure);
  EXPECT_TRUE(contains(none.v2.reason, "test-none") && contains(none.v2.reason, "; ") && contains(none.v2.reason, "test-init"))
      << none.v2.reason;
}

DispatcherOptions options_for(const std::string& path, bool v2) {
  DispatcherOptions o;
  o.hidden = 256;
  o.num_experts = 8;
  o.num_topk = 2;
  o.use_v2 = v2;
  o.mode = DispatchMode::kNormal;
  o.num_max_prefill_tokens_per_rank = 8;
  o.num_max_dispatch_tokens_per_rank = 8;
  o.provider_path = path;
  o.timeout_secs = 30;
  return o;
}

// A requested generation that is missing is reported when it is requested, on every rank.
TEST(Probe, MissingGenerationIsReportedWhenRequested) {
  run_ranks(2, {}, [&](Group& g, std::vector<std::string>& bad) {
    const CaseSpec s = make_spec(2, 1, 8, 2, 4, 256, 1);
    const Inputs in = to_tensors(s, reference::make_inputs(s, g.rank()));
    BufferCache cache(g);
    TokenDispatcher v2(cache, options_for(kV1Only, true));  // constructing reports nothing yet
    const Caught c = catch_error([&] { v2.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill); });
    if (c.type != "InvalidArgument" || !contains(c.message, "V2 was requested") || !contains(c.message, "offers V1 only"))
      bad.push_back(c.type + ": " + c.message);
    // The V1 generation of the same library works, through its dlopen'd table.
    TokenDispatcher v1(cache, options_for(kV1Only, false));
    const DispatchOutput out = v1.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill);
    if (out.provider != "test-v1" || cache.stats().current_provider != "test-v1") bad.push_back("provider not reported");
    v1.combine(Tensor::zeros({out.hidden_states.size(0), 256}, DType::kBF16));
  });
}

// Through a loaded provider the results are those of the built-in one, bit for bit.
TEST(Probe, LoadedProviderGivesTheBuiltinResults) {
  run_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    const CaseSpec s = make_spec(4, 1, 8, 2, 8, 256, 5);
    std::vector<RankInputs> all = reference::make_all_inputs(s);
    const Inputs in = to_tensors(s, all[static_cast<size_t>(g.rank())]);
    Tensor results[2];
    for (int i = 0; i < 2; ++i) {
      BufferCache cache(g);
      TokenDispatcher d(cache, options_for(i == 0 ? "cpu" : kBoth, true));
      const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill);
      if (out.provider != (i == 0 ? "cpu" : "test-both")) bad.push_back("wrong provider: " + out.provider);
      results[i] = d.combine(expert_outputs(s, {}, all, g.rank(), out));
    }
    if (std::memcmp(results[0].data(), results[1].data(), results[0].nbytes()) != 0) bad.push_back("results differ");
  });
}

// Rank 2 lacks V2: it raises its reason; every other rank raises PeerError naming rank 2.
TEST(Probe, RanksThatDisagreeAreNamedOnEveryRank) {
  run_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    const CaseSpec s = make_spec(4, 1, 8, 2, 4, 256, 2);
    const Inputs in = to_tensors(s, reference::make_inputs(s, g.rank()));
    BufferCache cache(g);
    TokenDispatcher d(cache, options_for(g.rank() == 2 ? kV1Only : kBoth, true));
    const Caught c = catch_error([&] { d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill); });
    if (g.rank() == 2) {
      if (c.type != "InvalidArgument" || !contains(c.message, "offers V1 only")) bad.push_back(c.type + ": " + c.message);
    } else if (c.type != "PeerError" || c.ranks != std::vector<int>{2} || !contains(c.message, "rank 2: ") ||
               !contains(c.message, "offers V1 only")) {
      bad.push_back(c.type + ": " + c.message);
    }
    // The cache is still usable: every rank asks for V1 now (offered everywhere, by different
    // providers: rank 2's test-v1 and the others' test-both), which is refused by name too.
    TokenDispatcher v1(cache, options_for(g.rank() == 2 ? kV1Only : kBoth, false));
    const Caught p = catch_error([&] { v1.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill); });
    const std::vector<int> others = g.rank() == 2 ? std::vector<int>{0, 1, 3} : std::vector<int>{2};
    if (p.type != "PeerError" || !contains(p.message, "ranks disagree on the provider for V1: ") ||
        !contains(p.message, "on rank [2]") || p.ranks != others)
      bad.push_back("providers: " + p.type + ": " + p.message);
  });
}

// The checks of a provider table, without a library: what a loaded library's entry point could
// return.
TEST(Probe, TablesAreCheckedBeforeUse) {
  static int inits = 0;
  inits = 0;
  provider::Table good = provider::builtin();
  good.name = "table-test";
  good.init = [] {
    ++inits;
    return static_cast<const char*>(nullptr);
  };
  ProviderProbe p;
  ASSERT_TRUE(dispatcher::accept_table("lib.so", &good, p)) << p.error;
  EXPECT_EQ(p.name, "table-test");
  EXPECT_TRUE(p.offers_v1 && p.offers_v2);
  EXPECT_TRUE(p.error.empty());
  EXPECT_EQ(inits, 1);

  auto refused = [](const provider::Table* table) {
    ProviderProbe probe;
    EXPECT_FALSE(dispatcher::accept_table("lib.so", table, probe));
    EXPECT_FALSE(probe.offers_v1 || probe.offers_v2);
    EXPECT_TRUE(contains(probe.error, "lib.so")) << probe.error;
    return probe.error;
  };
  EXPECT_TRUE(contains(refused(nullptr), "returned no provider table"));
  provider::Table t = good;
  t.abi_version = 7;
  EXPECT_TRUE(contains(refused(&t), "built for ABI 7"));
  t = good;
  t.table_bytes = sizeof(provider::Table) + 8;
  EXPECT_TRUE(contains(refused(&t), fmt::format("table of {} bytes", sizeof(provider::Table) + 8)));
  t = good;
  t.name = nullptr;
  EXPECT_TRUE(contains(refused(&t), "name is null"));
  t.name = "";
  EXPECT_TRUE(contains(refused(&t), "name is \"\""));
  t.name = "tab\there";
  EXPECT_TRUE(contains(refused(&t), "printable"));
  const std::string long_name(65, 'n');
  t.name = long_name.c_str();
  EXPECT_TRUE(contains(refused(&t), "longer than 64 characters"));
  EXPECT_EQ(inits, 1) << "init runs only for a table that passed its checks";
  t = good;
  t.init = [] { return "no device"; };
  EXPECT_TRUE(contains(refused(&t), "(provider 'table-test'): init failed: no device"));
  t.init = []() -> const char* { throw std::runtime_error("driver missing"); };
  EXPECT_TRUE(contains(refused(&t), "init failed: driver missing"));
  t = good;
  t.init = nullptr;
  t.create_elastic = nullptr;
  ASSERT_TRUE(dispatcher::accept_table("lib.so", &t, p));
  EXPECT_TRUE(p.offers_v1);
  EXPECT_FALSE(p.offers_v2);
}

}  // namespace
}  // namespace moe_ep::testing
