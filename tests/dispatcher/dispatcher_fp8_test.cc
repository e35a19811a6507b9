// FP8 wire format through the dispatcher, chosen by MOE_EP_DISPATCH_DTYPE=fp8: the rows and
// scales every format delivers (V1 and V2, normal and low-latency, one node and two) are the
// reference quantizer's cast of the source tokens (tests/reference/numeric_reference.hh), with
// plain, power-of-two (round_scale) and UE8M0-packed scales, on inputs spanning the exponent
// range; combine matches the reference too.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/env_scope.hh"
#include "support/dispatcher_fixture.hh"

namespace moe_ep::testing {
namespace dispatcher_fp8_test {

constexpr int kHidden = 640, kExperts = 16, kTopk = 4, kCap = 6;  // 640: a partly used UE8M0 word

struct Fp8Case {
  bool v2;
  DispatchMode mode;
  int scaleout;
  bool round_scale, ue8m0;
};

void run_case(const Fp8Case& c, std::uint64_t seed) {
  ScopedEnvironment fp8("MOE_EP_DISPATCH_DTYPE", "fp8");
  const int ranks = 4;
  const std::string label = fmt::format("{} {} {} nodes round_scale {} ue8m0 {}", c.v2 ? "V2" : "V1", mode_name(c.mode),
                                        c.scaleout, c.round_scale, c.ue8m0);
  run_ranks(ranks, {.num_scaleout = c.scaleout}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    DispatcherOptions o;
    o.hidden = kHidden;
    o.num_experts = kExperts;
    o.num_topk = kTopk;
    o.use_v2 = c.v2;
    o.mode = c.mode;
    o.num_max_dispatch_tokens_per_rank = kCap;
    o.num_max_prefill_tokens_per_rank = kCap;
    o.timeout_secs = 60;
    o.provider_path = "cpu";
    o.round_scale = c.round_scale;
    o.use_ue8m0 = c.ue8m0;
    TokenDispatcher d(cache, o);
    if (*d.options().dispatch_dtype != WireDType::kFP8) bad.push_back(label + ": MOE_EP_DISPATCH_DTYPE=fp8 was not taken");
    CaseSpec s = make_spec(ranks, c.scaleout, kExperts, kTopk, kCap, kHidden, seed);
    s.wide_range = true;
    run_batch(g, d, s, c.mode == DispatchMode::kLowLatency ? BatchKind::kDecode : BatchKind::kPrefill, bad, label);
  });
}

TEST(DispatcherFp8, EveryPathCastsAsTheReference) {
  std::uint64_t seed = 900;
  for (bool v2 : {false, true})
    for (DispatchMode mode : {DispatchMode::kNormal, DispatchMode::kLowLatency}) {
      for (int scales = 0; scales < 3; ++scales) run_case({v2, mode, 1, scales >= 1, scales == 2}, seed++);
      run_case({v2, mode, 2, true, true}, seed++);
    }
}

}  // namespace dispatcher_fp8_test
}  // namespace moe_ep::testing
