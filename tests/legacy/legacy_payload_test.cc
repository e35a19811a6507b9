// V1 normal dispatch of payload dtypes and of NVFP4 token triples (docs/semantics.md, "Payload
// dtypes"; docs/quantized-formats.md, "NVFP4 normal dispatch"). Payload rows of random bits are
// checked by the legacy harness against the dense reference; every received NVFP4 row is compared
// with the source row the dense reference (not the code under test) says it came from.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "moe_ep/legacy_buffer.hpp"
#include "reference/dense_reference.hh"
#include "support/errors.hh"
#include "support/legacy_harness.hh"

namespace moe_ep {
namespace legacy_payload_test {

using reference::CaseSpec;
using reference::RankInputs;
using testing::catch_error;
using testing::Caught;
using testing::collect_on_ranks;
using testing::expect_legacy_case;
using testing::LegacyRunOptions;
using testing::report_problems;

CaseSpec spec_for(int ranks, int scaleout, int hidden, int element_bytes, std::uint64_t seed) {
  CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.num_experts = ranks * 3;
  s.k = std::min(4, s.num_experts);
  s.max_tokens = 10;
  s.hidden = hidden;
  s.payload_element_bytes = element_bytes;
  s.seed = seed;
  s.mask_ratio = 0.2;
  s.num_bias = 1;
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r % 3 == 2 ? 0 : 10 - r);
  return s;
}

TEST(LegacyPayload, DtypesBitIdenticalOnOneNodeAndAcrossNodes) {
  const struct {
    DType dtype;
    int hidden;
  } payloads[] = {{DType::kFP16, 24}, {DType::kFP32, 12}, {DType::kInt8, 32}, {DType::kInt16, 8}, {DType::kInt32, 4}};
  const struct {
    int ranks, scaleout;
  } topologies[] = {{1, 1}, {4, 1}, {4, 2}, {8, 4}};
  std::uint64_t seed = 40;
  for (const auto& topo : topologies)
    for (const auto& p : payloads)
      for (int variant = 0; variant < 3; ++variant) {
        CaseSpec s = spec_for(topo.ranks, topo.scaleout, p.hidden, static_cast<int>(element_size(p.dtype)), ++seed);
        s.alignment = variant == 2 ? 4 : 1;
        LegacyRunOptions o;
        o.payload_dtype = p.dtype;
        o.cached_new_inputs = true;
        o.async = variant == 1;
        if (variant == 2 && topo.scaleout == 1) o.num_worst_tokens = 10 * topo.ranks;  // intranode only
        SCOPED_TRACE(testing::describe(s, o));
        expect_legacy_case(s, o);
      }
}

// ---- NVFP4 token triples -----------------------------------------------------------------------

struct Triple {
  int n = 0, hidden = 0, scale_cols = 0;
  std::vector<std::int32_t> packed, sf;  // [n, H/8], [n, H/64]
  std::vector<float> sf_scale;           // [n, S]
  Nvfp4Tokens view() {
    return {TensorView(packed.data(), DType::kInt32, {n, hidden / 8}), TensorView(sf.data(), DType::kInt32, {n, hidden / 64}),
            TensorView(sf_scale.data(), DType::kFP32, {n, scale_cols})};
  }
};

// Random bits in all three parts (NaN patterns of sf_scale included: nothing is interpreted).
Triple random_triple(int n, int hidden, int scale_cols, std::uint64_t seed) {
  Triple t{n, hidden, scale_cols, {}, {}, {}};
  std::mt19937_64 rng(seed);
  t.packed.resize(static_cast<size_t>(n) * hidden / 8);
  t.sf.resize(static_cast<size_t>(n) * hidden / 64);
  t.sf_scale.resize(static_cast<size_t>(n) * scale_cols);
  for (auto& v : t.packed) v = static_cast<std::int32_t>(rng());
  for (auto& v : t.sf) v = static_cast<std::int32_t>(rng());
  for (auto& v : t.sf_scale) {
    const auto bits = static_cast<std::uint32_t>(rng());
    std::memcpy(&v, &bits, sizeof v);
  }
  return t;
}

std::uint64_t triple_seed(std::uint64_t base, int rank) { return base * 1000003ULL + static_cast<std::uint64_t>(rank); }

template <class T>
bool same_row(const Tensor& got, std::int64_t row, const std::vector<T>& source, int token, int cols) {
  if (got.ndim() != 2 || got.size(1) != cols || got.stride(0) != cols) return false;
  return std::memcmp(got.data_as<const T>() + row * cols, source.data() + static_cast<size_t>(token) * cols,
                     sizeof(T) * static_cast<size_t>(cols)) == 0;
}

// Every real row of `rows` against the source rows the reference names.
void check_triples(const reference::RefDispatch& ref, const std::vector<Triple>& sources, const Nvfp4Rows& rows,
                   std::int64_t rows_out, const std::string& what, std::vector<std::string>& bad) {
  const Triple& any = sources.front();
  for (const auto& [name, t, dtype] : {std::tuple{"packed", &rows.packed, DType::kInt32}, {"sf", &rows.sf, DType::kInt32},
                                       {"sf_scale", &rows.sf_scale, DType::kFP32}})
    if (!t->defined() || t->dtype() != dtype || t->ndim() != 2 || t->size(0) != rows_out || !t->is_contiguous()) {
      bad.push_back(fmt::format("{}received {} is {}, expected contiguous {}[{}, ...]", what, name,
                                t->defined() ? t->describe() : "undefined", dtype_name(dtype), rows_out));
      return;
    }
  for (std::size_t i = 0; i < ref.rows.size(); ++i) {
    const auto& r = ref.rows[i];
    const Triple& src = sources[static_cast<size_t>(r.source)];
    const auto row = static_cast<std::int64_t>(i);
    if (!same_row(rows.packed, row, src.packed, r.token, any.hidden / 8) ||
        !same_row(rows.sf, row, src.sf, r.token, any.hidden / 64) ||
        !same_row(rows.sf_scale, row, src.sf_scale, r.token, any.scale_cols))
      bad.push_back(fmt::format("{}row {} is not rank {} token {}", what, i, r.source, r.token));
  }
}

struct Nvfp4Case {
  int ranks = 4, hidden = 128, scale_cols = 1;
  bool async = false;
  int num_worst_tokens = 0;
};

// The handle's hidden is H: combine takes bfloat16 [rows, H] and sums as for any dispatch.
void check_nvfp4_combine(Buffer& buffer, const CaseSpec& spec, std::vector<RankInputs>& all, int me,
                         const reference::RefDispatch& ref, const LegacyDispatchResult& res, std::int64_t rows_out, bool async,
                         const std::string& what, std::vector<std::string>& bad) {
  const int H = spec.hidden;
  RankInputs& in = all[static_cast<size_t>(me)];
  const std::int64_t n = in.num_tokens;
  const auto M = static_cast<std::int64_t>(ref.rows.size());
  Tensor y = Tensor::empty({rows_out, H}, DType::kBF16);
  std::fill(y.data_as<std::uint16_t>(), y.data_as<std::uint16_t>() + rows_out * H, std::uint16_t{0x7fc1});
  for (std::int64_t i = 0; i < M; ++i) {
    const auto& row = ref.rows[static_cast<size_t>(i)];
    for (int h = 0; h < H; ++h)
      y.data_as<std::uint16_t>()[i * H + h] = spec.value(me, -1, row.source * spec.max_tokens + row.token, h);
  }
  LegacyCombineArgs cargs{.x = y, .handle = res.handle, .async_finish = async};
  for (auto& b : in.bias) cargs.bias.push_back(TensorView(b.data(), DType::kBF16, {n, H}));
  const Caught combine_error = catch_error([&] {
    CombineResult combined = buffer.combine(cargs);
    combined.event.wait();
    const auto expected = reference::reference_combine(spec, all, me, 1.0f);
    for (std::int64_t t = 0; t < n; ++t)
      if (std::memcmp(combined.combined_x.data_as<std::uint16_t>() + t * H, &expected.x[static_cast<size_t>(t * H)],
                      sizeof(std::uint16_t) * static_cast<size_t>(H)) != 0)
        bad.push_back(fmt::format("{}combined_x[{}] differs", what, t));
  });
  if (!combine_error.message.empty()) bad.push_back(what + "combine: " + combine_error.message);
}

void run_nvfp4(const Nvfp4Case& c, std::uint64_t seed) {
  CaseSpec spec = testing::legacy_reference_spec(spec_for(c.ranks, 1, c.hidden, 0, seed));
  std::vector<RankInputs> all = reference::make_all_inputs(spec);  // the routing
  std::vector<Triple> first, second;
  for (int r = 0; r < c.ranks; ++r) {
    const int n = all[static_cast<size_t>(r)].num_tokens;
    first.push_back(random_triple(n, c.hidden, c.scale_cols, triple_seed(seed, r)));
    second.push_back(random_triple(n, c.hidden, c.scale_cols, triple_seed(seed + 7, r)));
  }
  const auto failures = collect_on_ranks(c.ranks, {}, [&](Group& g, std::vector<std::string>& bad) {
    const int me = g.rank(), k = spec.k;
    const std::string what = fmt::format("[rank {}] H {} S {} async {} worst {}: ", me, c.hidden, c.scale_cols, c.async,
                                         c.num_worst_tokens);
    Buffer buffer(g, {.num_rdma_bytes = 4 << 20, .num_cpu_timeout_secs = 60});
    RankInputs& in = all[static_cast<size_t>(me)];
    const std::int64_t n = in.num_tokens;
    TensorView topk(in.topk.data(), DType::kInt64, {n, k});
    TensorView weights(in.weights.data(), DType::kFP32, {n, k});
    const DispatchLayout layout = buffer.get_dispatch_layout(topk, spec.num_experts);
    LegacyDispatchArgs args{.x_nvfp4 = first[static_cast<size_t>(me)].view(),
                            .num_tokens_per_rank = layout.num_tokens_per_rank,
                            .is_token_in_rank = layout.is_token_in_rank,
                            .num_tokens_per_expert = layout.num_tokens_per_expert,
                            .topk_idx = topk,
                            .topk_weights = weights,
                            .num_worst_tokens = c.num_worst_tokens,
                            .async_finish = c.async};
    LegacyDispatchResult res = buffer.dispatch(args);
    res.event.wait();
    const auto ref = reference::reference_dispatch(spec, all, me);
    const auto M = static_cast<std::int64_t>(ref.rows.size());
    const std::int64_t rows_out = c.num_worst_tokens > 0 ? c.num_worst_tokens : M;
    if (res.recv_x.defined()) bad.push_back(what + "recv_x must be undefined with x_nvfp4");
    if (!res.recv_x_nvfp4) {
      bad.push_back(what + "recv_x_nvfp4 is missing");
      return;
    }
    check_triples(ref, first, *res.recv_x_nvfp4, rows_out, what, bad);
    for (std::int64_t i = 0; i < M; ++i) {
      if (res.handle->recv_src_idx.data_as<const std::int32_t>()[i] != ref.rows[static_cast<size_t>(i)].token)
        bad.push_back(fmt::format("{}recv_src_idx[{}]", what, i));
      for (int j = 0; j < k; ++j)
        if (res.recv_topk_idx.data_as<const std::int64_t>()[i * k + j] != ref.rows[static_cast<size_t>(i)].local_ids[static_cast<size_t>(j)])
          bad.push_back(fmt::format("{}recv_topk_idx[{}, {}]", what, i, j));
    }

    // Cached dispatch of new triples with the handle: the same layout places them.
    LegacyDispatchResult cached = buffer.dispatch(
        {.x_nvfp4 = second[static_cast<size_t>(me)].view(), .handle = res.handle, .async_finish = c.async});
    cached.event.wait();
    if (!cached.recv_x_nvfp4) {
      bad.push_back(what + "cached: recv_x_nvfp4 is missing");
    } else {
      check_triples(ref, second, *cached.recv_x_nvfp4, rows_out, what + "cached: ", bad);
    }

    check_nvfp4_combine(buffer, spec, all, me, ref, res, rows_out, c.async, what, bad);
  });
  report_problems(failures);
}

TEST(LegacyNvfp4, RoundTripInNormalOrderWithCachedReplay) {
  std::uint64_t seed = 3;
  for (const Nvfp4Case& c : {Nvfp4Case{4, 128, 1}, Nvfp4Case{4, 64, 3}, Nvfp4Case{4, 192, 4, true},
                             Nvfp4Case{2, 1024, 2, false, 20}, Nvfp4Case{1, 128, 1}, Nvfp4Case{3, 256, 5, true, 30}})
    run_nvfp4(c, ++seed);
}

constexpr int kRanks = 2, kTokens = 4, kExperts = 4, kTopk = 2, kHidden = 128;

// NVFP4 dispatch with `edit` applied on rank `bad_rank`'s arguments; returns every rank's error.
template <class Edit>
std::vector<Caught> nvfp4_dispatch(int ranks, int scaleout, int bad_rank, Edit edit) {
  std::vector<Caught> out(static_cast<size_t>(ranks));
  LocalWorld world(ranks, {.num_scaleout = scaleout});
  world.run([&](Group& g) {
    Buffer buffer(g, {.num_rdma_bytes = 4 << 20, .num_cpu_timeout_secs = 30});
    std::vector<std::int64_t> ids(kTokens * kTopk);
    for (int t = 0; t < kTokens; ++t) {
      ids[static_cast<size_t>(t * kTopk)] = t % kExperts;
      ids[static_cast<size_t>(t * kTopk + 1)] = -1;
    }
    TensorView topk(ids.data(), DType::kInt64, {kTokens, kTopk});
    const DispatchLayout layout = buffer.get_dispatch_layout(topk, kExperts);
    Triple tri = random_triple(kTokens, kHidden, 2, triple_seed(11, g.rank()));
    std::vector<std::uint8_t> spare(kTokens * kHidden * 4, 0);
    LegacyDispatchArgs a{.x_nvfp4 = tri.view(),
                         .num_tokens_per_rank = layout.num_tokens_per_rank,
                         .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                         .is_token_in_rank = layout.is_token_in_rank,
                         .num_tokens_per_expert = layout.num_tokens_per_expert,
                         .topk_idx = topk};
    if (g.rank() == bad_rank || bad_rank < 0) edit(a, spare.data());
    out[static_cast<size_t>(g.rank())] = catch_error([&] { buffer.dispatch(a); });
    // The buffer stays usable after a rejection every rank learnt of (one node only).
    if (scaleout == 1) {
      LegacyDispatchArgs good = a;
      good.x = TensorView();
      good.x_scales = TensorView();
      good.x_nvfp4 = tri.view();
      const Caught again = catch_error([&] { buffer.dispatch(good); });
      EXPECT_EQ(again.message, "") << "rank " << g.rank();
    }
  });
  return out;
}

TEST(LegacyNvfp4, RefusedAcrossNodes) {
  const auto out = nvfp4_dispatch(4, 2, -1, [](LegacyDispatchArgs&, std::uint8_t*) {});
  for (const auto& c : out) {
    EXPECT_EQ(c.type, "InvalidArgument") << c.message;
    EXPECT_NE(c.message.find("dispatch (NVFP4): x as an NVFP4 triple (packed, sf, sf_scale) is intranode only, as in "
                             "DeepEP's hybrid-ep: all ranks must be on one node, and this group spans 2 nodes"),
              std::string::npos)
        << c.message;
  }
}

TEST(LegacyNvfp4, BadTriplesNameTheArgumentValueAndRule) {
  using Edit = void (*)(LegacyDispatchArgs&, std::uint8_t*);
  const struct {
    Edit edit;
    const char* message;
  } cases[] = {
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->packed = TensorView(p, DType::kFP32, {kTokens, kHidden / 8}); },
       "x[0] (packed) has dtype float32, expected int32"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->sf = TensorView(p, DType::kFP32, {kTokens, kHidden / 64}); },
       "x[1] (sf) has dtype float32, expected int32"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->sf_scale = TensorView(p, DType::kBF16, {kTokens, 2}); },
       "x[2] (sf_scale) has dtype bfloat16, expected float32"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->packed = TensorView(p, DType::kInt32, {kTokens, 12}); },
       "x[0] (packed) has 12 columns (int32, eight E2M1 codes each: H/8), expected a positive multiple of 8"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->sf = TensorView(p, DType::kInt32, {kTokens, 3}); },
       "x[1] (sf) has 3 columns, expected H/64 = 2 (one int32 of four E4M3 scales per 64 elements) for the H = 128 "
       "that x[0] (packed) implies"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->sf_scale = TensorView(p, DType::kFP32, {kTokens - 1, 2}); },
       "x[2] (sf_scale) has 3 tokens but x[0] (packed) has 4: the three parts of x must have the same number of tokens"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->sf = TensorView(p, DType::kInt32, {kTokens + 1, 2}); },
       "x[1] (sf) has 5 tokens but x[0] (packed) has 4"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->sf_scale = TensorView(p, DType::kFP32, {kTokens, 0}); },
       "x[2] (sf_scale) has 0 columns, expected at least 1"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x_nvfp4->packed = TensorView(p, DType::kInt32, {kTokens}); },
       "x[0] (packed) has 1 dimensions, expected 2"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) {
         const std::int64_t shape[] = {kTokens, kHidden / 8}, strides[] = {kHidden / 4, 2};
         a.x_nvfp4->packed = TensorView(p, DType::kInt32, shape, strides);
       },
       "x[0] (packed) must have stride 1 in its last dimension"},
      {[](LegacyDispatchArgs& a, std::uint8_t* p) { a.x = TensorView(p, DType::kBF16, {kTokens, kHidden}); },
       "x_nvfp4 is given together with x: an NVFP4 dispatch takes the triple (packed, sf, sf_scale) alone"},
  };
  for (const auto& c : cases) {
    const auto out = nvfp4_dispatch(kRanks, 1, 1, c.edit);
    EXPECT_EQ(out[1].type, "InvalidArgument") << out[1].message;
    EXPECT_NE(out[1].message.find(std::string("[rank 1] dispatch (NVFP4): ") + c.message), std::string::npos)
        << out[1].message;
    EXPECT_EQ(out[0].type, "PeerError") << out[0].message;
    EXPECT_NE(out[0].message.find(c.message), std::string::npos) << out[0].message;
  }
}

// Ranks that mix an NVFP4 dispatch with another one disagree on the operation.
TEST(LegacyNvfp4, MixedWithAPlainDispatchIsADisagreement) {
  const auto out = nvfp4_dispatch(kRanks, 1, 0, [](LegacyDispatchArgs& a, std::uint8_t* p) {
    a.x_nvfp4.reset();
    a.x = TensorView(p, DType::kBF16, {kTokens, kHidden});
  });
  for (const auto& c : out) {
    EXPECT_EQ(c.type, "PeerError") << c.message;
    EXPECT_NE(c.message.find("dispatch (NVFP4)"), std::string::npos) << c.message;
  }
}

}  // namespace legacy_payload_test
}  // namespace moe_ep
