// MOE_EP_USE_V2 selects the buffer generation: every spelling of "off" (0, false, off, no, in any
// case) keeps V1 and every spelling of "on" selects V2, whether it comes from the process
// environment or from a scoped override; the generation shows in the dispatcher, in every
// dispatch output and in the buffer the cache builds. A DispatcherOptions field wins.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "support/env_scope.hh"
#include "support/dispatcher_fixture.hh"
#include "moe_ep/env.hpp"

namespace moe_ep::testing {
namespace {

DispatcherOptions options() {
  DispatcherOptions o;
  o.hidden = 128;
  o.num_experts = 8;
  o.num_topk = 2;
  o.mode = DispatchMode::kNormal;
  o.num_max_prefill_tokens_per_rank = 8;
  o.num_max_dispatch_tokens_per_rank = 8;
  o.provider_path = "cpu";
  o.timeout_secs = 60;
  return o;
}

// Two ranks: the dispatcher's generation, one batch checked against the reference, the cache's.
void expect_generation(Generation want, const std::string& what, std::optional<bool> field = std::nullopt) {
  run_ranks(2, {}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    DispatcherOptions o = options();
    o.use_v2 = field;
    TokenDispatcher d(cache, o);
    if (d.generation() != want) bad.push_back(what + ": dispatcher generation " + generation_name(d.generation()));
    const CaseSpec s = make_spec(2, 1, 8, 2, 8, 128, 3);
    run_batch(g, d, s, BatchKind::kPrefill, bad, what);
    std::vector<RankInputs> all = reference::make_all_inputs(s);
    const Inputs in = to_tensors(s, all[static_cast<size_t>(g.rank())]);
    const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kPrefill);
    if (out.generation != want) bad.push_back(what + ": output generation " + generation_name(out.generation));
    d.combine(expert_outputs(s, {}, all, g.rank(), out));
    if (cache.stats().current_generation != want) bad.push_back(what + ": the cache built the other generation");
  });
}

const char* const kOff[] = {"0", "false", "off", "no", "FALSE", "Off", "NO"};
const char* const kOn[] = {"1", "true", "on", "yes", "TRUE", "On"};

TEST(DispatcherGeneration, EnvironmentValuesOfOffKeepV1) {
  for (const char* value : kOff) {
    ScopedEnvironment set("MOE_EP_USE_V2", value);
    EXPECT_FALSE(env::get_bool("MOE_EP_USE_V2")) << value;
    expect_generation(Generation::kV1, std::string("MOE_EP_USE_V2=") + value);
  }
}

TEST(DispatcherGeneration, EnvironmentValuesOfOnSelectV2) {
  for (const char* value : kOn) {
    ScopedEnvironment set("MOE_EP_USE_V2", value);
    EXPECT_TRUE(env::get_bool("MOE_EP_USE_V2")) << value;
    expect_generation(Generation::kV2, std::string("MOE_EP_USE_V2=") + value);
  }
}

TEST(DispatcherGeneration, OverridesAndFieldsSelectTheSameWay) {
  for (const char* value : kOff) {
    env::ScopedOverride set("MOE_EP_USE_V2", value);
    expect_generation(Generation::kV1, std::string("override MOE_EP_USE_V2=") + value);
  }
  for (const char* value : kOn) {
    env::ScopedOverride set("MOE_EP_USE_V2", value);
    expect_generation(Generation::kV2, std::string("override MOE_EP_USE_V2=") + value);
    expect_generation(Generation::kV1, std::string("use_v2 = false over MOE_EP_USE_V2=") + value, false);
  }
  ScopedEnvironment set("MOE_EP_USE_V2", "off");
  expect_generation(Generation::kV2, "use_v2 = true over MOE_EP_USE_V2=off", true);
}

}  // namespace
}  // namespace moe_ep::testing
