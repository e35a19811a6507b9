// V2 low-latency mode on a backend that is not the built-in ElasticBuffer (a provider's own
// backend class, here one forwarding to this library's buffer): the dispatcher reaches it through
// DeepEP's API only and moves the expert groups into the slab itself (docs/dispatcher.md §5). Its
// outputs match the references and are bit-identical to the built-in provider's one-copy path.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

#include "support/dispatcher_fixture.hh"

namespace moe_ep::testing {
namespace {

constexpr int kHidden = 256, kExperts = 16, kTopk = 4, kCap = 8;

struct BackendCase {
  bool fp8;
  int scaleout;
};

Tensor run_low_latency(Group& g, const std::string& provider, const BackendCase& c, std::vector<std::string>& bad) {
  BufferCache cache(g);
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.num_topk = kTopk;
  o.use_v2 = true;
  o.mode = DispatchMode::kLowLatency;
  o.num_max_dispatch_tokens_per_rank = kCap;
  o.dispatch_dtype = c.fp8 ? WireDType::kFP8 : WireDType::kBF16;
  o.timeout_secs = 60;
  o.provider_path = provider;
  TokenDispatcher d(cache, o);
  const CaseSpec s = make_spec(g.size(), c.scaleout, kExperts, kTopk, kCap, kHidden, 5);
  return run_batch(g, d, s, BatchKind::kDecode, bad, provider);
}

class ForeignBackend : public ::testing::TestWithParam<BackendCase> {};

TEST_P(ForeignBackend, MatchesTheReferenceAndTheBuiltInPath) {
  const BackendCase c = GetParam();
  run_ranks(4, {.num_scaleout = c.scaleout}, [&](Group& g, std::vector<std::string>& bad) {
    const Tensor wrapped = run_low_latency(g, MOE_EP_TEST_provider_wrapped, c, bad);
    const Tensor builtin = run_low_latency(g, "cpu", c, bad);
    if (wrapped.nbytes() != builtin.nbytes() || std::memcmp(wrapped.data(), builtin.data(), wrapped.nbytes()) != 0)
      bad.push_back("combined outputs of the two backends differ");
  });
}

INSTANTIATE_TEST_SUITE_P(Dispatcher, ForeignBackend,
                         ::testing::Values(BackendCase{false, 1}, BackendCase{true, 1}, BackendCase{false, 2}),
                         [](const ::testing::TestParamInfo<BackendCase>& info) {
                           return fmt::format("{}_{}nodes", info.param.fp8 ? "fp8" : "bf16", info.param.scaleout);
                         });

}  // namespace
}  // namespace moe_ep::testing
