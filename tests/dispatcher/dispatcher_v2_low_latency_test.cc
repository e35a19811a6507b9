// V2 low-latency mode through the dispatcher (docs/dispatcher.md §5), both of its paths:
//  - a backend that is not the built-in ElasticBuffer (a provider's own backend class, here one
//    forwarding to this library's buffer): the dispatcher reaches it through DeepEP's API only and
//    moves the expert groups into the slab itself. Its outputs match the references and are
//    bit-identical to the built-in provider's one-copy path;
//  - the built-in path with an expert output whose expert stride is not R x cap rows (a view of
//    a taller slab): combined through one contiguous copy, still exactly the reference.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

#include "support/dispatcher_fixture.hh"

namespace moe_ep::testing {
namespace dispatcher_v2_low_latency_test {

constexpr int kHidden = 256, kExperts = 16, kTopk = 4, kCap = 8;

struct BackendCase {
  bool fp8;
  int scaleout;
};

DispatcherOptions options(const std::string& provider, bool fp8) {
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.num_topk = kTopk;
  o.use_v2 = true;
  o.mode = DispatchMode::kLowLatency;
  o.num_max_dispatch_tokens_per_rank = kCap;
  o.dispatch_dtype = fp8 ? WireDType::kFP8 : WireDType::kBF16;
  o.timeout_secs = 60;
  o.provider_path = provider;
  return o;
}

Tensor run_low_latency(Group& g, const std::string& provider, const BackendCase& c, std::vector<std::string>& bad) {
  BufferCache cache(g);
  DispatcherOptions o = options(provider, c.fp8);
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

TEST(V2LowLatency, ExpertOutputWithAnotherExpertStride) {
  run_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    TokenDispatcher d(cache, options("cpu", false));
    const CaseSpec s = make_spec(g.size(), 1, kExperts, kTopk, kCap, kHidden, 9);
    std::vector<RankInputs> all = reference::make_all_inputs(s);
    const Inputs in = to_tensors(s, all[static_cast<size_t>(g.rank())]);
    const Expectation e = expectation(d.options());
    const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kDecode);
    const Tensor y = expert_outputs(s, e, all, g.rank(), out);  // [El, R x cap, H]
    // The same rows in a slab of R x cap + 3 rows per expert, seen as [El, R x cap, H].
    const std::int64_t El = y.size(0), RC = y.size(1), H = y.size(2);
    Tensor tall = Tensor::zeros({El, RC + 3, H}, DType::kBF16);
    for (std::int64_t i = 0; i < El; ++i)
      std::memcpy(tall.data_as<std::uint16_t>() + i * (RC + 3) * H, y.data_as<const std::uint16_t>() + i * RC * H,
                  static_cast<std::size_t>(RC * H) * sizeof(std::uint16_t));
    const std::int64_t shape[] = {El, RC, H}, strides[] = {(RC + 3) * H, H, 1};
    const Tensor view = tall.with_view(TensorView(tall.data(), DType::kBF16, shape, strides));
    check_combined(expected_combine(s, e, all, g.rank(), out), d.combine(view), "combined", bad);
  });
}

}  // namespace dispatcher_v2_low_latency_test
}  // namespace moe_ep::testing
