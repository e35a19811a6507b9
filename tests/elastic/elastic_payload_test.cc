// Payload dtypes of dispatch (docs/semantics.md, "Payload dtypes"): float16, float32, int8, int16,
// int32 and uint8 rows of random bits arrive bit for bit on every path (direct, hybrid, direct
// across nodes), in both layouts, with cached replays; the row rule (a multiple of 16 bytes), the
// relaxed FP8 rule and combine's bfloat16-only rule are typed errors.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "support/elastic_harness.hh"
#include "support/errors.hh"

namespace moe_ep::testing {
namespace {

struct Payload {
  DType dtype;
  int hidden;  // rows of a multiple of 16 bytes, not all of them a multiple of 128 elements
};
constexpr Payload kPayloads[] = {{DType::kFP16, 40},  {DType::kFP32, 20}, {DType::kInt8, 48},
                                 {DType::kInt16, 72}, {DType::kInt32, 4}, {DType::kUInt8, 16}};

reference::CaseSpec payload_case(int ranks, int scaleout, bool hybrid, const Payload& p, std::uint64_t seed) {
  reference::CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.allow_hybrid = hybrid;
  s.num_experts = ranks * 3;
  s.k = std::min(4, s.num_experts);
  s.max_tokens = 12;
  s.hidden = p.hidden;
  s.payload_element_bytes = static_cast<int>(element_size(p.dtype));
  s.seed = seed;
  s.mask_ratio = 0.2;
  s.num_bias = 1;
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r % 3 == 2 ? 0 : 12 - r);
  return s;
}

// Every payload dtype on every path, compact and expanded, cached with the same and with new
// inputs, synchronous and asynchronous, with and without CPU sync.
TEST(PayloadDtypes, BitIdenticalOnEveryPathAndLayout) {
  const struct {
    int ranks, scaleout;
    bool hybrid;
  } topologies[] = {{1, 1, true}, {4, 1, true}, {4, 2, true}, {4, 2, false}, {8, 4, true}, {6, 3, true}};
  std::uint64_t seed = 500;
  for (const auto& topo : topologies) {
    for (const Payload& p : kPayloads) {
      for (int variant = 0; variant < 4; ++variant) {
        auto s = payload_case(topo.ranks, topo.scaleout, topo.hybrid, p, ++seed);
        s.expand = variant & 1;
        s.alignment = s.expand ? 4 : 1;
        s.multi = variant != 1;
        RunOptions o;
        o.payload_dtype = p.dtype;
        o.cached_new_inputs = true;
        o.async = variant & 2;
        o.cpu_sync = variant != 3;
        o.zero_padding = s.expand && variant == 1;
        SCOPED_TRACE(describe(s, o));
        expect_elastic_case(s, o);
      }
    }
  }
}

// FP8 rows need a multiple of 16 bytes, not of 128 elements: the scales are opaque (any P), in
// row- or column-major layout, compact and expanded.
TEST(PayloadDtypes, Fp8HiddenMultipleOf16) {
  for (const int hidden : {16, 48, 208}) {
    for (int variant = 0; variant < 4; ++variant) {
      reference::CaseSpec s = payload_case(4, 2, true, {DType::kUInt8, hidden}, 900 + variant);
      s.payload_element_bytes = 0;
      s.fp8 = true;
      s.scale_cols = variant + 1;
      s.expand = variant & 1;
      s.alignment = s.expand ? 8 : 1;
      RunOptions o;
      o.col_major_scales = variant & 2;
      o.cached_new_inputs = true;
      SCOPED_TRACE(describe(s, o));
      expect_elastic_case(s, o);
    }
  }
}

constexpr int kRanks = 2, kExperts = 4, kTopk = 2, kTokens = 4;

struct Outcome {
  std::string type, message;
};

DispatchArgs base_args(const TensorView& x, std::vector<std::int64_t>& topk) {
  topk.assign(kTokens * kTopk, 0);
  for (int t = 0; t < kTokens; ++t) {
    topk[static_cast<size_t>(t * kTopk)] = t % kExperts;
    topk[static_cast<size_t>(t * kTopk + 1)] = (t + 1) % kExperts;
  }
  return {.x = x, .topk_idx = TensorView(topk.data(), DType::kInt64, {kTokens, kTopk}), .num_experts = kExperts};
}

// x of `dtype` [kTokens, hidden] on rank `bad_rank`, BF16 [kTokens, 64] on the others.
std::vector<Outcome> dispatch_with(DType dtype, int hidden, int bad_rank) {
  return results_on_ranks<Outcome>(kRanks, {}, [&](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = kTokens, .num_cpu_timeout_secs = 30});
    std::vector<std::uint8_t> bytes(static_cast<size_t>(kTokens) * 64 * 8, 0);
    std::vector<std::int64_t> topk;
    const bool mine = g.rank() == bad_rank;
    DispatchArgs a = base_args(mine ? TensorView(bytes.data(), dtype, {kTokens, hidden})
                                    : TensorView(bytes.data(), DType::kBF16, {kTokens, 64}),
                               topk);
    const Caught c = catch_error([&] { b.dispatch(a); });
    return Outcome{c.type, c.message};
  });
}

TEST(PayloadDtypes, RowRuleNamesTheArgumentValueAndRule) {
  const struct {
    DType dtype;
    int hidden;
    const char* message;
  } cases[] = {
      {DType::kFP16, 12, "x is float16 [4, 12]: a row is 24 bytes, which must be a multiple of 16 (hidden x element "
                         "size, here hidden must be a multiple of 8)"},
      {DType::kBF16, 4, "x is bfloat16 [4, 4]: a row is 8 bytes, which must be a multiple of 16"},
      {DType::kFP32, 6, "x is float32 [4, 6]: a row is 24 bytes, which must be a multiple of 16 (hidden x element "
                        "size, here hidden must be a multiple of 4)"},
      {DType::kInt8, 24, "x is int8 [4, 24]: a row is 24 bytes, which must be a multiple of 16"},
      {DType::kInt16, 9, "x is int16 [4, 9]: a row is 18 bytes"},
      {DType::kBool, 16, "x has dtype bool; the payload must have 1-, 2- or 4-byte elements"},
      {DType::kInt64, 2, "x has dtype int64; the payload must have 1-, 2- or 4-byte elements"},
  };
  for (const auto& c : cases) {
    const auto out = dispatch_with(c.dtype, c.hidden, 1);
    EXPECT_EQ(out[1].type, "InvalidArgument") << out[1].message;
    EXPECT_NE(out[1].message.find(c.message), std::string::npos) << out[1].message;
    EXPECT_NE(out[1].message.find("[rank 1] dispatch"), std::string::npos) << out[1].message;
    EXPECT_EQ(out[0].type, "PeerError") << out[0].message;
  }
  // Scales only go with FP8.
  const std::vector<Outcome> out = results_on_ranks<Outcome>(kRanks, {}, [&](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = kTokens, .num_cpu_timeout_secs = 30});
    std::vector<std::uint16_t> x(kTokens * 16);
    std::vector<float> scales(kTokens);
    std::vector<std::int64_t> topk;
    DispatchArgs a = base_args(TensorView(x.data(), DType::kFP16, {kTokens, 16}), topk);
    a.x_scales = TensorView(scales.data(), DType::kFP32, {kTokens, 1});
    const Caught c = catch_error([&] { b.dispatch(a); });
    return Outcome{c.type, c.message};
  });
  for (const auto& o : out) {
    EXPECT_EQ(o.type, "InvalidArgument");
    EXPECT_NE(o.message.find("x_scales is given but x is float16 (scales go with float8_e4m3fn x only)"),
              std::string::npos) << o.message;
  }
}

TEST(PayloadDtypes, Fp8BufferHiddenRule) {
  LocalWorld world(1);
  world.run([&](Group& g) {
    const Caught bad = catch_error([&] {
      ElasticBuffer b(g, {.num_max_tokens_per_rank = 4, .hidden = 200, .use_fp8_dispatch = true});
    });
    EXPECT_EQ(bad.type, "InvalidArgument");
    EXPECT_NE(bad.message.find("hidden = 200 must be a multiple of 16 with use_fp8_dispatch"), std::string::npos)
        << bad.message;
    EXPECT_EQ(catch_error([&] { ElasticBuffer b(g, {.num_max_tokens_per_rank = 4, .hidden = 208, .use_fp8_dispatch = true}); })
                  .message,
              "");
  });
}

// Combine reduces bfloat16 rows only, whatever the dispatch moved.
TEST(PayloadDtypes, CombineRefusesNonBf16) {
  for (const DType dtype : {DType::kFP16, DType::kFP32, DType::kInt16}) {
    std::vector<Outcome> out(kRanks);
    LocalWorld world(kRanks);
    world.run([&](Group& g) {
      ElasticBuffer b(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = kTokens, .num_cpu_timeout_secs = 30});
      std::vector<std::uint32_t> x(kTokens * 16, 0x3c003c00u);
      std::vector<std::int64_t> topk;
      const DispatchResult d = b.dispatch(base_args(TensorView(x.data(), dtype, {kTokens, 16}), topk));
      EXPECT_EQ(d.recv_x.dtype(), dtype);
      const std::int64_t rows = d.recv_x.size(0);
      std::vector<std::uint32_t> y(static_cast<size_t>(rows) * 16, 0);
      const bool mine = g.rank() == 0;
      const Caught c = catch_error([&] {
        b.combine({.x = TensorView(y.data(), mine ? dtype : DType::kBF16, {rows, 16}), .handle = d.handle});
      });
      out[static_cast<size_t>(g.rank())] = {c.type, c.message};
      // The buffer stays usable: a bfloat16 combine of the same handle works.
      EXPECT_EQ(catch_error([&] { b.combine({.x = TensorView(y.data(), DType::kBF16, {rows, 16}), .handle = d.handle}); })
                    .message,
                "");
    });
    EXPECT_EQ(out[0].type, "InvalidArgument") << out[0].message;
    const std::string expected = fmt::format("[rank 0] combine: x has dtype {} ({}[", dtype_name(dtype), dtype_name(dtype));
    EXPECT_NE(out[0].message.find(expected), std::string::npos) << out[0].message;
    EXPECT_NE(out[0].message.find("combine reduces bfloat16 rows only"), std::string::npos) << out[0].message;
    EXPECT_EQ(out[1].type, "PeerError") << out[1].message;
  }
}

// A cached dispatch may move another dtype than the first call, with the same hidden size.
TEST(PayloadDtypes, CachedDispatchWithAnotherDtype) {
  LocalWorld world(kRanks);
  world.run([&](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = kTokens, .num_cpu_timeout_secs = 30});
    std::vector<std::uint16_t> x16(kTokens * 16);
    std::vector<std::uint32_t> x32(kTokens * 16);
    for (int i = 0; i < kTokens * 16; ++i) {
      x16[static_cast<size_t>(i)] = static_cast<std::uint16_t>(g.rank() * 1000 + i);
      x32[static_cast<size_t>(i)] = 0x7f800001u + static_cast<std::uint32_t>(g.rank() * 1000 + i);  // NaN bits
    }
    std::vector<std::int64_t> topk;
    const DispatchResult first = b.dispatch(base_args(TensorView(x16.data(), DType::kBF16, {kTokens, 16}), topk));
    const DispatchResult again =
        b.dispatch({.x = TensorView(x32.data(), DType::kFP32, {kTokens, 16}), .handle = first.handle});
    EXPECT_EQ(again.recv_x.dtype(), DType::kFP32);
    if (again.recv_x.size(0) != first.recv_x.size(0)) {
      ADD_FAILURE() << "cached dispatch: " << again.recv_x.size(0) << " rows, first " << first.recv_x.size(0);
      return;
    }
    const auto* meta = first.handle->recv_src_metadata.data_as<const std::int32_t>();
    for (std::int64_t i = 0; i < first.recv_x.size(0); ++i) {
      const int src = meta[i * (kTopk + 2)] / kTokens, token = meta[i * (kTopk + 2)] % kTokens;
      for (int h = 0; h < 16; ++h) {
        const std::uint32_t expected = 0x7f800001u + static_cast<std::uint32_t>(src * 1000 + token * 16 + h);
        EXPECT_EQ(again.recv_x.data_as<const std::uint32_t>()[i * 16 + h], expected) << "row " << i << " h " << h;
      }
    }
  });
}

}  // namespace
}  // namespace moe_ep::testing
