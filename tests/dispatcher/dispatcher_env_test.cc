// The dispatcher's typed configuration: unset options take their environment variables; bad
// values name the variable and the accepted values; options override the environment; scoped
// overrides restore the previous state. Mode, wire dtype and batch kind names parse both ways.
#include <gtest/gtest.h>

#include <cstdlib>

#include "support/dispatcher_fixture.hh"
#include "moe_ep/env.hpp"
#include "support/env_scope.hh"
#include "support/text.hh"

namespace moe_ep::testing {
namespace {

DispatcherOptions shape() {
  DispatcherOptions o;
  o.hidden = 256;
  o.num_experts = 8;
  o.num_topk = 2;
  return o;
}

TEST(DispatcherEnv, UnsetOptionsTakeTheEnvironment) {
  LocalWorld(2).run([&](Group& g) {
    BufferCache cache(g);
    {
      TokenDispatcher d(cache, shape());
      EXPECT_EQ(d.generation(), Generation::kV1);  // V2 is opt-in
      EXPECT_EQ(d.mode(), DispatchMode::kAuto);
      EXPECT_EQ(*d.options().num_max_dispatch_tokens_per_rank, 128);
      EXPECT_EQ(*d.options().dispatch_dtype, WireDType::kBF16);
      EXPECT_EQ(d.resolve(BatchKind::kPrefill), DispatchMode::kNormal);
      EXPECT_EQ(d.resolve(BatchKind::kDecode), DispatchMode::kLowLatency);
    }
    g.barrier();
    if (g.rank() == 0) {  // overrides are process-wide: one rank sets them
      env::ScopedOverride v2("MOE_EP_USE_V2", "1"), mode("MOE_EP_MODE", "LOW_LATENCY"),
          cap("MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "64"), dtype("MOE_EP_DISPATCH_DTYPE", "fp8"),
          layout("MOE_EP_V2_NORMAL_LAYOUT", "expanded");
      TokenDispatcher d(cache, shape());
      EXPECT_EQ(d.generation(), Generation::kV2);
      EXPECT_EQ(d.mode(), DispatchMode::kLowLatency);
      EXPECT_EQ(d.resolve(BatchKind::kPrefill), DispatchMode::kLowLatency);
      EXPECT_EQ(*d.options().num_max_dispatch_tokens_per_rank, 64);
      EXPECT_EQ(*d.options().dispatch_dtype, WireDType::kFP8);
      EXPECT_EQ(*d.options().v2_normal_layout, V2NormalLayout::kExpanded);
      DispatcherOptions fields = shape();
      fields.use_v2 = false;
      fields.mode = DispatchMode::kNormal;
      fields.num_max_dispatch_tokens_per_rank = 32;
      TokenDispatcher f(cache, fields);  // fields win over the environment
      EXPECT_EQ(f.generation(), Generation::kV1);
      EXPECT_EQ(f.mode(), DispatchMode::kNormal);
      EXPECT_EQ(*f.options().num_max_dispatch_tokens_per_rank, 32);
    }
    g.barrier();
    if (g.rank() == 0) {
      TokenDispatcher d(cache, shape());  // restored
      EXPECT_EQ(d.generation(), Generation::kV1);
      EXPECT_EQ(env::current("MOE_EP_USE_V2").source, env::Source::kDefault);
    }
  });
}

TEST(DispatcherEnv, BadValuesNameTheVariableAndTheAcceptedValues) {
  LocalWorld(1).run([&](Group& g) {
    BufferCache cache(g);
    struct Case {
      const char* name;
      const char* value;
      std::string message;
    };
    const Case cases[] = {
        {"MOE_EP_MODE", "fast", "MOE_EP_MODE=\"fast\" is invalid: accepted values are normal | low_latency | auto"},
        {"MOE_EP_USE_V2", "maybe", "MOE_EP_USE_V2=\"maybe\" is invalid: accepted values are 1/true/on/yes or 0/false/off/no"},
        {"MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "-5", "MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=\"-5\" is invalid"},
        {"MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "0",
         "MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=\"0\" is invalid: accepted values are integers from 1 to 1048576"},
        {"MOE_EP_DISPATCH_DTYPE", "fp16", "accepted values are bf16 | fp8"},
        {"MOE_EP_V2_NORMAL_LAYOUT", "dense", "accepted values are compact | expanded | hybrid_ep"},
        {"MOE_EP_TIMEOUT_SECS", "soon", "MOE_EP_TIMEOUT_SECS=\"soon\" is invalid: accepted values are a positive, finite number"},
        {"MOE_EP_TIMEOUT_SECS", "0", "MOE_EP_TIMEOUT_SECS=\"0\" is invalid: accepted values are a positive, finite number"},
        {"MOE_EP_TIMEOUT_SECS", "inf", "MOE_EP_TIMEOUT_SECS=\"inf\" is invalid: accepted values are a positive, finite number"},
        {"MOE_EP_NUM_WORKERS", "4096",
         "MOE_EP_NUM_WORKERS=\"4096\" is invalid: accepted values are integers from 0 to 1024"},
    };
    for (const Case& c : cases) {
      ScopedEnvironment set(c.name, c.value);
      const Caught e = catch_error([&] { TokenDispatcher d(cache, shape()); });
      EXPECT_EQ(e.type, "InvalidArgument") << c.name;
      EXPECT_TRUE(contains(e.message, c.message)) << e.message;
    }
    // Option fields are named as fields.
    DispatcherOptions o = shape();
    o.num_max_dispatch_tokens_per_rank = 0;
    EXPECT_TRUE(contains(catch_error([&] { TokenDispatcher d(cache, o); }).message,
                         "DispatcherOptions.num_max_dispatch_tokens_per_rank = 0 is out of range"));
    o = shape();
    o.num_workers = 1025;  // the limit of num_sms and MOE_EP_NUM_WORKERS
    EXPECT_TRUE(contains(catch_error([&] { TokenDispatcher d(cache, o); }).message,
                         "DispatcherOptions.num_workers = 1025 is out of range: expected 0 to 1024"));
    o = shape();
    o.num_experts = 0;
    EXPECT_TRUE(contains(catch_error([&] { TokenDispatcher d(cache, o); }).message,
                         "DispatcherOptions.num_experts = 0 is out of range"));
    o = shape();
    o.hidden = 200;
    o.dispatch_dtype = WireDType::kFP8;
    EXPECT_TRUE(contains(catch_error([&] { TokenDispatcher d(cache, o); }).message, "multiple of 128, got 200"));
    o = shape();
    o.use_ue8m0 = true;
    EXPECT_TRUE(contains(catch_error([&] { TokenDispatcher d(cache, o); }).message, "needs round_scale"));
    // An override is validated when it is made.
    EXPECT_THROW(env::ScopedOverride("MOE_EP_MODE", "fast"), InvalidArgument);
  });
}

TEST(DispatcherEnv, OutOfRangeValuesAreReportedAsGiven) {
  LocalWorld(1).run([&](Group& g) {
    BufferCache cache(g);
    // Values beyond any limit are named as they were written, not as a clamped stand-in.
    for (const auto& [name, value] : {std::pair{"MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "1099511627776"},
                                      {"MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK", "1099511627776"},
                                      {"MOE_EP_NUM_WORKERS", "4294967297"}}) {
      ScopedEnvironment set(name, value);
      const Caught e = catch_error([&] { TokenDispatcher d(cache, shape()); });
      EXPECT_EQ(e.type, "InvalidArgument") << name;
      EXPECT_TRUE(contains(e.message, name)) << e.message;
      EXPECT_TRUE(contains(e.message, value)) << e.message;
      EXPECT_FALSE(contains(e.message, "1073741824")) << e.message;
      EXPECT_FALSE(contains(e.message, "1048576 is")) << e.message;
    }
  });
}

TEST(DispatcherNames, ParseIsTheInverseOfTheNames) {
  for (DispatchMode m : {DispatchMode::kNormal, DispatchMode::kLowLatency, DispatchMode::kAuto})
    EXPECT_EQ(parse_mode(mode_name(m)), m);
  for (WireDType d : {WireDType::kBF16, WireDType::kFP8, WireDType::kNVFP4}) EXPECT_EQ(parse_wire_dtype(wire_dtype_name(d)), d);
  for (BatchKind k : {BatchKind::kPrefill, BatchKind::kDecode}) EXPECT_EQ(parse_batch_kind(batch_kind_name(k)), k);
  EXPECT_EQ(parse_wire_dtype("bfloat16"), WireDType::kBF16);
  EXPECT_EQ(parse_batch_kind("extend"), BatchKind::kPrefill);
}

TEST(DispatcherNames, AnUnknownNameIsRefusedNamingTheArgumentAndTheAcceptedValues) {
  const auto message = [](auto parse) {
    try {
      parse();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message([] { parse_mode("fast", "--mode"); }), "--mode = 'fast' is not one of normal | low_latency | auto");
  EXPECT_EQ(message([] { parse_wire_dtype("fp4"); }), "dispatch_dtype = 'fp4' is not one of bf16 | bfloat16 | fp8 | nvfp4");
  EXPECT_EQ(message([] { parse_batch_kind("train"); }), "kind = 'train' is not one of prefill | extend | decode");
}

}  // namespace
}  // namespace moe_ep::testing
