// One V2 contract for both providers (docs/architecture.md "One V2 contract"): the built-in
// provider (ElasticBuffer over the engine) and the CUDA provider (ElasticDevice over HostExec, its
// whole host path) are given the same bad combine and cached-dispatch calls, on every rank, and
// must raise the same exception type with the same message on each rank. The expected outcome of
// each case is written here by hand from docs/semantics.md (which argument the message names),
// so a provider that refuses a call the other accepts, or words a refusal differently, fails.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cuda/elastic_device.hh"
#include "cuda/host_exec.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/group.hpp"
#include "support/errors.hh"

namespace moe_ep::testing::parity {
namespace {

using Device = cuda::ElasticDevice<cuda::testing::HostExec>;
constexpr DLDevice kCuda0{kDLCUDA, 0};
constexpr int kRanks = 2, kTokens = 4, kHidden = 16, kTopk = 2, kExperts = 4;

// The provider's own views: host memory labelled as the CUDA provider's device (HostExec's
// "device" memory is host memory), unchanged for the built-in provider.
struct Side {
  DLDevice device;
  TensorView at(TensorView v) const { return v.defined() ? v.on_device(device) : v; }
};

// The inputs of one rank, kept alive for the calls of a case.
struct Inputs {
  std::vector<std::uint16_t> x = std::vector<std::uint16_t>(kTokens * kHidden, 0x3f80);
  std::vector<std::int64_t> ids;
  std::vector<std::uint16_t> y;       // combine input rows (bf16 1.0), wide enough for every case
  std::vector<float> weights;         // combine weights, large enough for every case
  std::vector<std::uint16_t> bias = std::vector<std::uint16_t>(kTokens * kHidden * 2, 0);
};

// What a case changes in a valid combine (its args) or a valid cached dispatch.
struct Case {
  const char* name;
  const char* names;  // the text the refusal must contain ("" = the call is accepted)
  std::function<void(CombineArgs&, std::int64_t rows, Inputs&, EPHandle&)> combine;
  std::function<void(DispatchArgs&, Inputs&, EPHandle&)> cached;
};

TensorView bf16(std::vector<std::uint16_t>& v, std::int64_t rows, std::int64_t cols) {
  return TensorView(v.data(), DType::kBF16, {rows, cols});
}

std::vector<Case> cases() {
  using C = CombineArgs;
  return {
      {"no handle", "handle is missing", [](C& a, auto, auto&, auto&) { a.handle = nullptr; }, {}},
      {"changed num_recv_tokens", "handle.num_recv_tokens",
       [](C&, auto, auto&, EPHandle& h) { h.num_recv_tokens += 1; }, {}},
      {"changed hidden", "handle.hidden", [](C&, auto, auto&, EPHandle& h) { h.hidden = 8; }, {}},
      {"changed do_expand", "handle.do_expand", [](C&, auto, auto&, EPHandle& h) { h.do_expand = true; }, {}},
      {"x missing", "x is missing", [](C& a, auto, auto&, auto&) { a.x = TensorView(); }, {}},
      {"x float32", "combine reduces bfloat16 rows only",
       [](C& a, std::int64_t rows, Inputs& in, auto&) {
         a.x = TensorView(in.y.data(), DType::kFP32, {rows, kHidden / 2});
       },
       {}},
      {"x one row short", "x has", [](C& a, std::int64_t rows, Inputs& in, auto&) { a.x = bf16(in.y, rows - 1, kHidden); },
       {}},
      {"x strided columns", "stride 1",
       [](C& a, std::int64_t rows, Inputs& in, auto&) {
         const std::int64_t shape[] = {rows, kHidden / 2}, strides[] = {kHidden, 2};
         a.x = TensorView(in.y.data(), DType::kBF16, shape, strides);
       },
       {}},
      // Combine's hidden is x's own (the handle carries the dispatch's): both providers accept it.
      {"x narrower than the dispatch", "",
       [](C& a, std::int64_t rows, Inputs& in, auto&) { a.x = bf16(in.y, rows, kHidden / 2); }, {}},
      {"weights of the wrong shape", "topk_weights",
       [](C& a, std::int64_t rows, Inputs& in, auto&) {
         a.topk_weights = TensorView(in.weights.data(), DType::kFP32, {rows, kTopk + 1});
       },
       {}},
      {"weights bfloat16", "topk_weights has dtype",
       [](C& a, std::int64_t rows, Inputs& in, auto&) { a.topk_weights = bf16(in.y, rows, kTopk); }, {}},
      {"three biases", "bias tensors given",
       [](C& a, auto, Inputs& in, auto&) { a.bias.assign(3, bf16(in.bias, kTokens, kHidden)); }, {}},
      {"bias of the wrong width", "bias[0]",
       [](C& a, auto, Inputs& in, auto&) { a.bias = {bf16(in.bias, kTokens, kHidden * 2)}; }, {}},
      {"num_sms negative", "num_sms = -1", [](C& a, auto, auto&, auto&) { a.num_sms = -1; }, {}},
      // Cached dispatch against its handle.
      {"cached: topk_idx given", "topk_idx must not be given", {},
       [](DispatchArgs& a, Inputs& in, auto&) { a.topk_idx = TensorView(in.ids.data(), DType::kInt64, {kTokens, kTopk}); }},
      {"cached: other num_experts", "num_experts = 8 differs", {}, [](DispatchArgs& a, auto&, auto&) { a.num_experts = 8; }},
      {"cached: fewer tokens", "x has 3 tokens", {},
       [](DispatchArgs& a, Inputs& in, auto&) { a.x = bf16(in.x, kTokens - 1, kHidden); }},
      {"cached: changed num_tokens", "handle.num_tokens", {}, [](DispatchArgs&, auto&, EPHandle& h) { h.num_tokens = 1; }},
      {"cached: do_cpu_sync", "do_cpu_sync", {}, [](DispatchArgs& a, auto&, auto&) { a.do_cpu_sync = true; }},
  };
}

// Runs every case on one provider (`make` builds it on a rank) and returns, per case, each rank's error.
// A tensor's description names its device when it is not the host's ("float32[6, 8] on cuda:0"):
// the one difference the two providers' messages may have.
std::string without_device(std::string message) {
  const std::string label = " on cuda:0";
  for (std::size_t at; (at = message.find(label)) != std::string::npos;) message.erase(at, label.size());
  return message;
}

template <class Make>
std::vector<std::vector<Caught>> run_cases(Side side, Make make) {
  const std::vector<Case> all = cases();
  std::vector<std::vector<Caught>> caught(all.size(), std::vector<Caught>(kRanks));
  LocalWorld world(kRanks);
  world.run([&](Group& group) {
    ElasticBufferConfig config;
    config.num_max_tokens_per_rank = kTokens;
    config.num_bytes = std::int64_t{16} << 20;  // no fixed hidden: combine may narrow x
    config.explicitly_destroy = true;
    auto buffer = make(group, config);
    const int me = group.rank();
    Inputs in;
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kTopk; ++j) in.ids.push_back((t + j + me) % kExperts);
    DispatchArgs dispatch;
    dispatch.x = side.at(bf16(in.x, kTokens, kHidden));
    dispatch.topk_idx = side.at(TensorView(in.ids.data(), DType::kInt64, {kTokens, kTopk}));
    dispatch.num_experts = kExperts;
    const DispatchResult made = buffer->dispatch(dispatch);
    const std::int64_t rows = made.handle->num_recv_tokens;
    in.y.assign(static_cast<size_t>(rows * kHidden * 2), 0x3f80);
    in.weights.assign(static_cast<size_t>(rows * (kTopk + 1)), 1.0f);
    for (std::size_t c = 0; c < all.size(); ++c) {
      auto handle = std::make_shared<EPHandle>(*made.handle);
      caught[c][static_cast<size_t>(me)] = catch_error([&] {
        if (all[c].combine) {
          CombineArgs a;
          a.x = bf16(in.y, rows, kHidden);
          a.handle = handle;
          all[c].combine(a, rows, in, *handle);
          a.x = side.at(a.x);
          a.topk_weights = side.at(a.topk_weights);
          for (TensorView& b : a.bias) b = side.at(b);
          buffer->combine(a);
        } else {
          DispatchArgs a;
          a.x = bf16(in.x, kTokens, kHidden);
          a.handle = handle;
          all[c].cached(a, in, *handle);
          a.x = side.at(a.x);
          a.topk_idx = side.at(a.topk_idx);
          buffer->dispatch(a);
        }
      });
    }
    buffer->destroy();
  });
  return caught;
}

TEST(ProviderParity, BadCallsAreRefusedAlikeByBothProviders) {
  const auto builtin = run_cases(Side{{kDLCPU, 0}}, [](Group& group, const ElasticBufferConfig& config) {
    return std::make_unique<ElasticBuffer>(group, config);
  });
  const auto device = run_cases(Side{kCuda0}, [](Group& group, const ElasticBufferConfig& config) {
    return std::make_unique<Device>(group, config, 0);
  });
  const std::vector<Case> all = cases();
  for (std::size_t c = 0; c < all.size(); ++c)
    for (int r = 0; r < kRanks; ++r) {
      const Caught& b = builtin[c][static_cast<size_t>(r)];
      const Caught& d = device[c][static_cast<size_t>(r)];
      SCOPED_TRACE(::testing::Message() << "case '" << all[c].name << "', rank " << r);
      const std::string expected_type = *all[c].names ? "InvalidArgument" : "";
      EXPECT_EQ(b.type, expected_type) << b.message;
      EXPECT_NE(b.message.find(all[c].names), std::string::npos) << b.message;
      EXPECT_EQ(d.type, b.type) << d.message;
      EXPECT_EQ(without_device(d.message), b.message);
    }
}

}  // namespace
}  // namespace moe_ep::testing::parity
