// MPI transport tests, run under mpirun (tests/CMakeLists.txt starts them with 2, 4 and 8
// processes and logical topologies 1xN, 2x2, 2x4, 4x2 through MOE_EP_RANKS_PER_NODE).
//
// Every process runs every test on its rank. Property cases are the randomized cases of the
// in-process suite on this job's rank count and topology, checked against the dense reference;
// rank 0 also runs each case on in-process ranks and requires every rank's outputs to be
// bit-identical to the in-process transport's. Failures are reported by the rank that saw them.
#include <gtest/gtest.h>
#include <mpi.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <numeric>
#include <optional>
#include <tuple>

#include "comm/transport.hh"
#include "alltoallv_baseline.hh"
#include "shared_window_baseline.hh"
#include "support/dispatcher_fixture.hh"
#include "support/elastic_harness.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "moe_ep/mpi.hpp"
#include "reference/numeric_reference.hh"

namespace moe_ep::testing {

Group* g_group = nullptr;  // the job's group (tests/mpi/mpi_puts_test.cc uses it too)

namespace {

std::vector<std::uint64_t> gather_u64(Group& group, std::uint64_t mine) {
  const comm::Gathered all =
      group.transport().all_gather(std::as_bytes(std::span(&mine, 1)), comm::Scope::kWorld, {"test: gather", 120});
  std::vector<std::uint64_t> out;
  for (int r = 0; r < all.size(); ++r) out.push_back(all.as<std::uint64_t>(r));
  return out;
}

TEST(MpiTransport, GroupMatchesTheJob) {
  Group& g = *g_group;
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(g.rank(), rank);
  EXPECT_EQ(g.size(), size);
  EXPECT_EQ(g.num_scaleout() * g.num_scaleup(), size);
  // The topology CTest asked for (MOE_EP_RANKS_PER_NODE), or one node per host: the ranks MPI
  // puts on this rank's host (on pretend hosts, fewer than the job).
  MPI_Comm host_comm = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host_comm);
  int host_size = 0;
  MPI_Comm_size(host_comm, &host_size);
  MPI_Comm_free(&host_comm);
  const auto per_node = env::get_int("MOE_EP_RANKS_PER_NODE");
  EXPECT_EQ(g.num_scaleup(), per_node > 0 ? per_node : host_size);
  // A world all-gather delivers every rank's block in rank order.
  const auto all = gather_u64(g, 1000 + static_cast<std::uint64_t>(rank));
  for (int r = 0; r < size; ++r) EXPECT_EQ(all[static_cast<size_t>(r)], 1000u + static_cast<std::uint64_t>(r));
}

// Communicators that cannot be a group: MPI_COMM_NULL, and an intercommunicator (even ranks and
// odd ranks as its two sides), each refused with InvalidArgument on every rank before any exchange.
TEST(MpiTransport, NullAndIntercommunicatorsAreRejected) {
  Group& g = *g_group;
  try {
    mpi::make_group(MPI_COMM_NULL);
    ADD_FAILURE() << "MPI_COMM_NULL was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("MPI_COMM_NULL"), std::string::npos) << e.what();
  }
  MPI_Comm side = MPI_COMM_NULL, inter = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, g.rank() % 2, g.rank(), &side), MPI_SUCCESS);
  ASSERT_EQ(MPI_Intercomm_create(side, 0, MPI_COMM_WORLD, g.rank() % 2 == 0 ? 1 : 0, 77, &inter), MPI_SUCCESS);
  try {
    mpi::make_group(inter, {.ranks_per_node = 0, .timeout_secs = 60});
    ADD_FAILURE() << "an intercommunicator was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("intercommunicator"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(fmt::format("[rank {}]", g.rank() / 2)), std::string::npos) << e.what();
  }
  MPI_Comm_free(&inter);
  MPI_Comm_free(&side);
}

// Any communicator, not only the world: two halves of the job run their own cases concurrently.
TEST(MpiTransport, GroupFromASplitCommunicator) {
  Group& g = *g_group;
  if (g.size() < 4) GTEST_SKIP() << "needs 4 ranks to split";
  const int half = g.rank() < g.size() / 2 ? 0 : 1;
  MPI_Comm comm = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, half, g.rank(), &comm), MPI_SUCCESS);
  {
    auto sub = mpi::make_group(comm, {.ranks_per_node = 0, .timeout_secs = 60});
    MPI_Comm_free(&comm);  // the group holds its own duplicate
    EXPECT_EQ(sub->size(), g.size() / 2);
    EXPECT_EQ(sub->rank(), g.rank() % (g.size() / 2));
    RunOptions options;
    const auto spec = random_case(static_cast<std::uint64_t>(8100 + half), sub->size(), sub->num_scaleout(), &options);
    SCOPED_TRACE(describe(spec, options));
    for (const auto& f : run_elastic_case(*sub, spec, options)) ADD_FAILURE() << f;
  }
  g.barrier(60);
}

TEST(MpiTransport, RandomCasesMatchReferenceAndInProcess) {
  Group& g = *g_group;
  const int cases = 10;
  for (int i = 0; i < cases; ++i) {
    RunOptions options;
    const auto spec = random_case(static_cast<std::uint64_t>(7000 + i), g.size(), g.num_scaleout(), &options);
    SCOPED_TRACE(describe(spec, options));
    std::uint64_t digest = 0;
    options.digest = &digest;
    for (const auto& f : run_elastic_case(g, spec, options)) ADD_FAILURE() << f;
    const auto digests = gather_u64(g, digest);
    if (g.rank() == 0) {
      options.digest = nullptr;
      const auto expected = in_process_digests(spec, options);
      for (int r = 0; r < g.size(); ++r)
        EXPECT_EQ(digests[static_cast<size_t>(r)], expected[static_cast<size_t>(r)])
            << "rank " << r << ": outputs over MPI differ from the in-process transport's";
    }
  }
}

TEST(MpiTransport, HybridAndDirectOnEveryLayout) {
  Group& g = *g_group;
  for (int variant = 0; variant < 8; ++variant) {
    reference::CaseSpec s;
    s.ranks = g.size();
    s.scaleout = g.num_scaleout();
    s.allow_hybrid = variant & 1;
    s.expand = variant & 2;
    s.fp8 = variant & 4;
    s.multi = !(variant & 1) || variant == 5;
    s.num_experts = s.ranks * 3;
    s.k = 4;
    s.max_tokens = 12;
    s.hidden = 128;
    s.scale_cols = s.fp8 ? 1 : 0;
    s.seed = 500 + static_cast<std::uint64_t>(variant);
    for (int r = 0; r < s.ranks; ++r) s.tokens.push_back(r % 3 == 1 ? 0 : 12 - r % 5);
    RunOptions o;
    o.async = variant & 1;
    SCOPED_TRACE(describe(s, o));
    for (const auto& f : run_elastic_case(g, s, o)) ADD_FAILURE() << f;
  }
}

// Inputs larger than the shared arena's first size, then a larger combine input: node peers must
// follow the arena as it grows between calls.
TEST(MpiTransport, SharedArenaGrowsBetweenCalls) {
  Group& g = *g_group;
  for (int tokens : {8, 160}) {
    reference::CaseSpec s;
    s.ranks = g.size();
    s.scaleout = g.num_scaleout();
    s.num_experts = s.ranks * 2;
    s.k = 4;
    s.max_tokens = tokens;
    s.hidden = 4096;
    s.seed = 900 + static_cast<std::uint64_t>(tokens);
    for (int r = 0; r < s.ranks; ++r) s.tokens.push_back(tokens - r % 3);
    RunOptions o;
    SCOPED_TRACE(describe(s, o));
    for (const auto& f : run_elastic_case(g, s, o)) ADD_FAILURE() << f;
  }
}

// The token dispatcher over MPI: both generations, prefill (normal) and decode (low-latency)
// batches in one sequence, checked end to end against the references.
TEST(MpiTransport, DispatcherBothGenerationsAutoMode) {
  Group& g = *g_group;
  for (bool v2 : {false, true}) {
    for (bool fp8 : {false, true}) {
      DispatcherOptions o;
      o.hidden = 256;
      o.num_experts = g.size() * 4;
      o.num_topk = 4;
      o.use_v2 = v2;
      o.mode = DispatchMode::kAuto;
      o.num_max_dispatch_tokens_per_rank = 8;
      o.num_max_prefill_tokens_per_rank = 24;
      o.dispatch_dtype = fp8 ? WireDType::kFP8 : WireDType::kBF16;
      o.timeout_secs = 60;
      o.provider_path = "cpu";
      BufferCache cache(g);
      TokenDispatcher d(cache, o);
      std::vector<std::string> bad;
      int round = 0;
      for (BatchKind kind : {BatchKind::kPrefill, BatchKind::kDecode, BatchKind::kPrefill}) {
        const bool decode = kind == BatchKind::kDecode;
        const CaseSpec spec = make_spec(g.size(), g.num_scaleout(), o.num_experts, o.num_topk, decode ? 8 : 24, o.hidden,
                                        static_cast<std::uint64_t>(40 + round));
        run_batch(g, d, spec, kind, bad, fmt::format("{} {} batch {}", v2 ? "V2" : "V1", fp8 ? "fp8" : "bf16", round++));
      }
      for (const auto& b : bad) ADD_FAILURE() << "[rank " << g.rank() << "] " << b;
    }
  }
}

// One scale-out message in flight per peer, and small messages: senders block on the bound and
// must drive progress (their own receives included) until a message completes.
TEST(MpiTransport, OneMessageInFlightPerPeer) {
  Group& g = *g_group;
  env::ScopedOverride chunk("MOE_EP_MPI_CHUNK_BYTES", "4096");
  for (bool hybrid : {true, false}) {
    reference::CaseSpec s;
    s.ranks = g.size();
    s.scaleout = g.num_scaleout();
    s.allow_hybrid = hybrid;
    s.num_experts = s.ranks * 4;
    s.k = 6;
    s.max_tokens = 48;
    s.hidden = 1024;
    s.seed = 77;
    for (int r = 0; r < s.ranks; ++r) s.tokens.push_back(48 - r);
    RunOptions o;
    o.num_allocated_qps = 1;
    SCOPED_TRACE(describe(s, o));
    for (const auto& f : run_elastic_case(g, s, o)) ADD_FAILURE() << f;
  }
}

// Tensors moe-ep allocated are mapped by node peers in place; other memory is copied once into
// the shared arena where node peers read it: a combine input. A dispatch reads x where it is
// (its sources push their rows), whoever allocated it. All give the same results.
TEST(MpiTransport, TensorsAllocatedByMoeEpAreSharedWithoutCopy) {
  Group& g = *g_group;
  if (g.num_scaleup() < 2) GTEST_SKIP() << "one rank per node: nothing is shared";
  const int T = 160, H = 4096, k = 2, E = g.size() * 2;  // 160 rows of 8 KiB: x is a large block (>= 1 MiB)
  ElasticBuffer buffer(g, {.num_max_tokens_per_rank = T, .hidden = H, .num_topk = k, .num_cpu_timeout_secs = 60});
  Tensor x = Tensor::empty({T, H}, DType::kBF16);
  std::vector<std::uint16_t> user_x(static_cast<size_t>(T) * H);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      user_x[static_cast<size_t>(t) * H + h] = x.data_as<std::uint16_t>()[t * H + h] =
          float_to_bf16(static_cast<float>((g.rank() * 7 + t + h) % 13));
  Tensor topk = Tensor::empty({T, k}, DType::kInt64);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) topk.data_as<std::int64_t>()[t * k + j] = (g.rank() + t + j * (E / 2)) % E;
  comm::Transport& transport = g.transport();
  std::vector<std::uint16_t> user_y;  // the combine input in memory moe-ep did not allocate
  auto run = [&](const TensorView& input, bool user_combine_input) {
    const std::uint64_t before = transport.shared_bytes_copied();
    DispatchResult d = buffer.dispatch({.x = input, .topk_idx = topk, .num_experts = E});
    const std::uint64_t after_dispatch = transport.shared_bytes_copied();
    TensorView y = d.recv_x;  // allocated by moe-ep
    if (user_combine_input) {
      user_y.assign(static_cast<const std::uint16_t*>(d.recv_x.data()),
                    static_cast<const std::uint16_t*>(d.recv_x.data()) + d.recv_x.numel());
      y = TensorView(user_y.data(), DType::kBF16, {d.recv_x.size(0), H});
    }
    CombineResult c = buffer.combine({.x = y, .handle = d.handle});
    const std::uint64_t after_combine = transport.shared_bytes_copied();
    return std::tuple{std::move(d), std::move(c), after_dispatch - before, after_combine - after_dispatch};
  };
  auto [d1, c1, x_copied, y_copied] = run(x, false);
  const std::size_t x_bytes = static_cast<std::size_t>(T) * H * 2;
  EXPECT_LT(x_copied, x_bytes) << "x was allocated by moe-ep: only the small tensors (top-k ids) are copied";
  EXPECT_EQ(y_copied, 0u) << "the combine input recv_x was allocated by moe-ep";
  auto [d2, c2, user_copied, user_y_copied] = run(TensorView(user_x.data(), DType::kBF16, {T, H}), true);
  EXPECT_LT(user_copied, x_bytes) << "the dispatch's sources push their rows from x where it is";
  EXPECT_GE(user_y_copied, d2.recv_x.nbytes()) << "a combine input moe-ep did not allocate is copied into the arena";
  ASSERT_EQ(d1.recv_x.nbytes(), d2.recv_x.nbytes());
  EXPECT_EQ(std::memcmp(d1.recv_x.data(), d2.recv_x.data(), d1.recv_x.nbytes()), 0);
  EXPECT_EQ(std::memcmp(c1.combined_x.data(), c2.combined_x.data(), c1.combined_x.nbytes()), 0);
  // Each token's combined row is the sum of its distinct ranks' copies of x: count * x.
  for (int t = 0; t < T; ++t) {
    const int a = static_cast<int>(topk.data_as<std::int64_t>()[t * k] / 2), b = static_cast<int>(topk.data_as<std::int64_t>()[t * k + 1] / 2);
    const float count = a == b ? 1.0f : 2.0f;
    for (int h = 0; h < H; h += 97)
      ASSERT_EQ(c1.combined_x.data_as<std::uint16_t>()[t * H + h],
                reference::bf16_from_float(count * reference::float_from_bf16(user_x[static_cast<size_t>(t) * H + h])))
          << "token " << t << " column " << h;
  }
}

// The benchmark's baseline is a correct dispatch and combine: the same rows in the same order as
// ElasticBuffer's compact layout, and (one node) the same combined rows, bit for bit.
TEST(MpiTransport, AlltoallvBaselineMatchesElasticBuffer) {
  Group& g = *g_group;
  const int T = 24, H = 256, k = 4, E = g.size() * 4, P = H / 128;
  ElasticBuffer buffer(g, {.num_max_tokens_per_rank = T, .hidden = H, .num_topk = k, .use_fp8_dispatch = true,
                           .num_cpu_timeout_secs = 60});
  bench::AlltoallvBaseline baseline(MPI_COMM_WORLD);
  const int n = T - g.rank() % 3;
  Tensor x = Tensor::empty({n, H}, DType::kFP8E4M3);
  Tensor scales = Tensor::empty({n, P}, DType::kFP32);
  Tensor topk = Tensor::empty({n, k}, DType::kInt64);
  Tensor weights = Tensor::empty({n, k}, DType::kFP32);
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) x.data_as<std::uint8_t>()[t * H + h] = static_cast<std::uint8_t>((g.rank() * 31 + t * 7 + h) % 113);
    for (int p = 0; p < P; ++p) scales.data_as<float>()[t * P + p] = 1.0f + static_cast<float>(t % 5) / 4;
    for (int j = 0; j < k; ++j) {
      topk.data_as<std::int64_t>()[t * k + j] = (j == 3 && t % 4 == 0) ? -1 : (g.rank() * 5 + t * 3 + j * 7) % E;
      weights.data_as<float>()[t * k + j] = 0.25f * static_cast<float>(j + 1);
    }
  }
  DispatchResult ours = buffer.dispatch({.x = x, .x_scales = scales, .topk_idx = topk, .topk_weights = weights, .num_experts = E});
  bench::BaselineDispatch theirs = baseline.dispatch(x, scales, topk, weights, E);
  ASSERT_EQ(theirs.recv_x.size(0), ours.recv_x.size(0));
  EXPECT_EQ(std::memcmp(theirs.recv_x.data(), ours.recv_x.data(), ours.recv_x.nbytes()), 0);
  EXPECT_EQ(std::memcmp(theirs.recv_x_scales.data(), ours.recv_x_scales.data(), ours.recv_x_scales.nbytes()), 0);
  EXPECT_EQ(std::memcmp(theirs.recv_topk_weights.data(), ours.recv_topk_weights.data(), ours.recv_topk_weights.nbytes()), 0);
  // Expert outputs: any BF16 rows, one per received row.
  const std::int64_t rows = ours.recv_x.size(0);
  Tensor y = Tensor::empty({rows, H}, DType::kBF16);
  for (std::int64_t i = 0; i < rows; ++i)
    for (int h = 0; h < H; ++h)
      y.data_as<std::uint16_t>()[i * H + h] = float_to_bf16(static_cast<float>((i * 13 + h + g.rank()) % 17) / 8.0f);
  const Tensor theirs_combined = baseline.combine(theirs, y);
  CombineResult ours_combined = buffer.combine({.x = y, .handle = ours.handle});
  ASSERT_EQ(theirs_combined.nbytes(), ours_combined.combined_x.nbytes());
  if (g.num_scaleout() == 1) {  // across nodes ours sums each node's rows first (one more BF16 rounding)
    EXPECT_EQ(std::memcmp(theirs_combined.data(), ours_combined.combined_x.data(), theirs_combined.nbytes()), 0);
  }
  // The one-node baseline (every rank on this host): the same rows, and the same combined tokens.
  if (g.transport().ranks_on_host() < g.size()) return;
  bench::SharedWindowBaseline shared(MPI_COMM_WORLD);
  for (int call = 0; call < 2; ++call) {  // the second call reuses the window and the outputs
    bench::BaselineDispatch routed = shared.dispatch(x, scales, topk, weights, E);
    ASSERT_EQ(routed.recv_x.size(0), rows);
    EXPECT_EQ(std::memcmp(routed.recv_x.data(), ours.recv_x.data(), ours.recv_x.nbytes()), 0);
    EXPECT_EQ(std::memcmp(routed.recv_x_scales.data(), ours.recv_x_scales.data(), ours.recv_x_scales.nbytes()), 0);
    EXPECT_EQ(std::memcmp(routed.recv_topk_idx.data(), theirs.recv_topk_idx.data(), theirs.recv_topk_idx.nbytes()), 0);
    EXPECT_EQ(std::memcmp(routed.recv_topk_weights.data(), ours.recv_topk_weights.data(), ours.recv_topk_weights.nbytes()),
              0);
    const TensorView outputs = shared.output_rows(rows, H);
    std::memcpy(outputs.data(), y.data(), y.nbytes());
    const Tensor combined = shared.combine(routed, outputs);
    if (g.num_scaleout() == 1) {
      EXPECT_EQ(std::memcmp(combined.data(), ours_combined.combined_x.data(), combined.nbytes()), 0);
    } else {
      EXPECT_EQ(std::memcmp(combined.data(), theirs_combined.data(), combined.nbytes()), 0);
    }
  }
}

// Bad input across processes: the rank with other arguments is named on every rank.
TEST(MpiTransport, DisagreeingHiddenNamesTheRank) {
  Group& g = *g_group;
  const int odd = g.size() - 1;
  ElasticBufferConfig c{.num_max_tokens_per_rank = 8, .hidden = g.rank() == odd ? 256 : 128, .num_topk = 2,
                        .num_cpu_timeout_secs = 60};
  try {
    ElasticBuffer buffer(g, c);
    ADD_FAILURE() << "construction with disagreeing hidden sizes succeeded";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("hidden"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(odd)), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected PeerError, got: " << e.what();
  }
}

TEST(MpiTransport, DisagreeingTopkInDispatchNamesTheRank) {
  Group& g = *g_group;
  ElasticBuffer buffer(g, {.num_max_tokens_per_rank = 4, .hidden = 128, .num_topk = 2, .num_cpu_timeout_secs = 60});
  const int k = g.rank() == 0 ? 1 : 2;
  Tensor x = Tensor::zeros({4, 128}, DType::kBF16);
  Tensor topk = Tensor::zeros({4, k}, DType::kInt64);
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < k; ++j) topk.data_as<std::int64_t>()[t * k + j] = j;
  try {
    buffer.dispatch({.x = x, .topk_idx = topk, .num_experts = g.size() * 2});
    ADD_FAILURE() << "dispatch with disagreeing top-k succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_topk: 1 on rank [0]"), std::string::npos) << e.what();
  }
  // The buffer stays usable after an error every rank raised alike.
  Tensor good = Tensor::zeros({4, 2}, DType::kInt64);
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 2; ++j) good.data_as<std::int64_t>()[t * 2 + j] = (g.rank() + j) % (g.size() * 2);
  DispatchResult res = buffer.dispatch({.x = x, .topk_idx = good, .num_experts = g.size() * 2});
  EXPECT_TRUE(res.recv_x.defined());
}

// num_experts, num_max_tokens_per_rank and the dtype of x, each differing on the last rank: every
// rank names the field, the values and the last rank; the next valid dispatch succeeds.
TEST(MpiTransport, DisagreeingExpertsTokensAndDtypeNameTheRank) {
  Group& g = *g_group;
  const int odd = g.size() - 1, T = 4, H = 128, k = 2, E = g.size() * 2;
  const bool is_odd = g.rank() == odd;
  ElasticBuffer buffer(g, {.num_max_tokens_per_rank = 8, .hidden = H, .num_topk = k, .num_cpu_timeout_secs = 60});
  Tensor x = Tensor::zeros({T, H}, DType::kBF16);
  Tensor x_fp8 = Tensor::zeros({T, H}, DType::kFP8E4M3);
  Tensor scales = Tensor::empty({T, H / 128}, DType::kFP32);
  for (std::int64_t i = 0; i < scales.numel(); ++i) scales.data_as<float>()[i] = 1.0f;
  Tensor topk = Tensor::empty({T, k}, DType::kInt64);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) topk.data_as<std::int64_t>()[t * k + j] = (g.rank() + t + j) % E;
  std::vector<int> others(static_cast<size_t>(odd));
  std::iota(others.begin(), others.end(), 0);
  auto expect_disagreement = [&](const DispatchArgs& args, std::initializer_list<std::string> fragments) {
    try {
      buffer.dispatch(args);
      ADD_FAILURE() << "dispatch succeeded; expected: " << *fragments.begin();
    } catch (const PeerError& e) {
      for (const std::string& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
      EXPECT_EQ(e.ranks(), is_odd ? others : std::vector<int>{odd}) << e.what();
    }
  };
  const std::string last = fmt::format("on rank [{}]", odd);
  DispatchArgs a{.x = x, .topk_idx = topk, .num_experts = is_odd ? 2 * E : E};
  expect_disagreement(a, {"ranks disagree on num_experts: ", fmt::format("{} {}", 2 * E, last)});
  a = {.x = x, .topk_idx = topk, .num_experts = E, .num_max_tokens_per_rank = is_odd ? 4 : 8};
  expect_disagreement(a, {fmt::format("ranks disagree on num_max_tokens_per_rank: 4 {}", last)});
  a = {.x = is_odd ? TensorView(x_fp8) : TensorView(x), .x_scales = is_odd ? TensorView(scales) : TensorView(),
       .topk_idx = topk, .num_experts = E};
  expect_disagreement(a, {fmt::format("ranks disagree on x dtype: bfloat16 on {} [{}], float8_e4m3fn {}",
                                      odd == 1 ? "rank" : "ranks", fmt::join(others, ", "), last)});
  DispatchResult ok = buffer.dispatch({.x = x, .topk_idx = topk, .num_experts = E});
  EXPECT_TRUE(ok.recv_x.defined());
}

TEST(MpiTransport, TopologyThatDoesNotFitIsRejected) {
  Group& g = *g_group;
  try {
    mpi::make_group(MPI_COMM_WORLD, {.ranks_per_node = g.size() + 1, .timeout_secs = 60});
    ADD_FAILURE() << "ranks_per_node larger than the communicator was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(g.size() + 1)), std::string::npos) << e.what();
  }
  if (g.size() < 2) return;
  // Ranks that ask for different topologies: every rank lists both groups of ranks and blames
  // the other one.
  std::vector<int> rest;
  for (int r = 1; r < g.size(); ++r) rest.push_back(r);
  try {
    mpi::make_group(MPI_COMM_WORLD, {.ranks_per_node = g.rank() == 0 ? 1 : g.size(), .timeout_secs = 60});
    ADD_FAILURE() << "disagreeing ranks_per_node was accepted";
  } catch (const PeerError& e) {
    const std::string held = fmt::format("ranks disagree on ranks_per_node: 1 on rank [0], {} on {} [{}]", g.size(),
                                         rest.size() == 1 ? "rank" : "ranks", fmt::join(rest, ", "));
    EXPECT_NE(std::string(e.what()).find(held), std::string::npos) << e.what();
    EXPECT_EQ(e.ranks(), g.rank() == 0 ? rest : std::vector<int>{0}) << e.what();
  }
}

TEST(MpiTransport, LegacyNormalAndLowLatencyAcrossNodes) {
  Group& g = *g_group;
  // V1 low-latency: every token to experts on every rank, hook receive, then combine; the
  // combined row of token t is sum_j w_j * x_t (experts are the identity here).
  const int H = 128, N = 6, k = 2, E = g.size() * 2;
  BufferConfig cfg{.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(N, H, g.size(), E),
                   .low_latency_mode = true,
                   .num_qps_per_rank = E / g.size(),
                   .num_cpu_timeout_secs = 60};
  Buffer buffer(g, cfg);
  Tensor x = Tensor::empty({N, H}, DType::kBF16);
  Tensor topk = Tensor::empty({N, k}, DType::kInt64);
  Tensor weights = Tensor::empty({N, k}, DType::kFP32);
  for (int t = 0; t < N; ++t) {
    for (int h = 0; h < H; ++h) x.data_as<std::uint16_t>()[t * H + h] = float_to_bf16(static_cast<float>((t + g.rank() + h) % 7));
    for (int j = 0; j < k; ++j) {
      topk.data_as<std::int64_t>()[t * k + j] = (g.rank() * 3 + t * 5 + j * (E / 2)) % E;
      weights.data_as<float>()[t * k + j] = j == 0 ? 0.5f : 0.25f;
    }
  }
  auto d = buffer.low_latency_dispatch({.x = x, .topk_idx = topk, .num_max_dispatch_tokens_per_rank = N,
                                        .num_experts = E, .use_fp8 = false});
  auto c = buffer.low_latency_combine({.x = d.recv_x, .topk_idx = topk, .topk_weights = weights, .handle = d.handle});
  for (int t = 0; t < N; ++t)
    for (int h = 0; h < H; ++h) {
      const float v = static_cast<float>((t + g.rank() + h) % 7);
      ASSERT_EQ(c.combined_x.data_as<std::uint16_t>()[t * H + h], reference::bf16_from_float(0.5f * v + 0.25f * v))
          << "token " << t << " column " << h;
    }
}

// Rank 1 gives up on a channel; its node peers wait for it at a node barrier and name it; the
// ranks of other nodes wait for records of rank 0, which gives up because of rank 1: they name
// rank 1, the root cause, not rank 0 (whether rank 1's own notice or rank 0's reaches them first:
// once a member gave up, every wait of the channel ends).
TEST(MpiTransport, ARankThatGaveUpBecauseOfAnotherNamesTheRootCause) {
  Group& g = *g_group;
  if (g.num_scaleup() < 2) GTEST_SKIP() << "needs nodes of 2 ranks or more (rank 0 waits for rank 1 in its node)";
  auto channel = g.transport().duplicate({"test: channel", 120});
  std::string message;
  std::vector<int> named;
  try {
    if (g.rank() == 1) {
      channel->abandon("[rank 1] its work failed", {});
    } else if (g.scaleout_rank() == 0) {
      channel->barrier(comm::Scope::kNode, {"node barrier", 120});
      ADD_FAILURE() << "the node barrier passed without rank 1";
    } else {
      const int from[] = {0};
      const std::uint64_t target[] = {1};
      channel->wait_signals(from, target, {"records of node 0", 120});
      ADD_FAILURE() << "signals arrived from rank 0";
    }
  } catch (const PeerError& e) {
    message = e.what();
    named = e.ranks();
  }
  if (g.rank() != 1) {
    EXPECT_EQ(named, std::vector<int>{1}) << message;
    EXPECT_NE(message.find("[rank 1] its work failed"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 1 gave up on this channel"), std::string::npos) << message;
  }
  g.barrier(120);  // the group's own channel is unaffected
}

// Timeouts name global ranks, whatever the scope: a node-scope barrier on the last node where only
// its first rank arrives, and a wait for signals of another node that never come. One rank waits,
// every other rank stays away, so the result does not depend on the machine's load.
TEST(MpiTransport, TimeoutsOnAnyNodeNameGlobalRanks) {
  Group& g = *g_group;
  auto channel = g.transport().duplicate({"test: channel", 120});
  const int su = g.num_scaleup(), last_node_first = (g.num_scaleout() - 1) * su;
  if (g.rank() == last_node_first && su > 1) {
    std::vector<int> others;
    for (int r = last_node_first + 1; r < last_node_first + su; ++r) others.push_back(r);
    try {
      channel->barrier(comm::Scope::kNode, {"node barrier", 0.5});
      ADD_FAILURE() << "expected a timeout";
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.ranks(), others) << e.what();
      EXPECT_NE(std::string(e.what()).find(fmt::format("waiting for ranks [{}]", fmt::join(others, ", "))),
                std::string::npos)
          << e.what();
    }
  }
  g.barrier(120);
  // Rank 0 waits for a signal of the first rank of the last node, which never sends one.
  auto signals = g.transport().duplicate({"test: channel", 120});
  if (g.rank() == 0 && g.num_scaleout() > 1) {
    const int from[] = {last_node_first};
    const std::uint64_t target[] = {1};
    try {
      signals->wait_signals(from, target, {"records of the last node", 0.5});
      ADD_FAILURE() << "expected a timeout";
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.ranks(), std::vector<int>{last_node_first}) << e.what();
    }
  }
  g.barrier(120);
}

// On ranks other than 0: only failed assertions, prefixed with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.message());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace moe_ep::testing

int main(int argc, char** argv) {
  moe_ep::mpi::Session session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {  // one report; every rank still fails its own assertions (and the exit status)
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new moe_ep::testing::RankFailurePrinter(rank));
  }
  auto group = moe_ep::mpi::make_group(MPI_COMM_WORLD);
  moe_ep::testing::g_group = group.get();
  int failed = RUN_ALL_TESTS();
  if (failed) std::fprintf(stderr, "[rank %d] %d test(s) failed\n", rank, failed);
  group.reset();
  return failed;
}
