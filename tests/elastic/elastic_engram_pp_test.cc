// ElasticBuffer's Engram storage, PP send/receive and barrier through the C++ API, on ranks as
// threads (one node and two logical nodes): fetched rows and scales against the rows every rank
// wrote (generated here from (rank, row, column)), PP messages against what their senders sent,
// and the main error paths (docs/engram-pp.md).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "support/errors.hh"
#include "support/rank_runner.hh"
#include "support/text.hh"

namespace moe_ep {
namespace elastic_engram_pp_test {

using testing::Caught;
using testing::catch_error;
using testing::contains;

constexpr std::int64_t kMiB2 = std::int64_t{2} << 20;
constexpr int kEntries = 6, kHidden = 64, kScales = 3;

struct World {
  int ranks;
  int nodes;
};

ElasticBufferConfig engram_config(double timeout = 30) {
  return {.num_bytes = 2 * kMiB2, .num_cpu_bytes = kMiB2, .num_cpu_timeout_secs = timeout};
}

// The element (row, col) of `rank`'s table: a distinct 16-bit pattern (bf16) or byte (fp8).
std::uint16_t bf16_at(int rank, int row, int col) { return static_cast<std::uint16_t>(rank * 4099 + row * 131 + col); }
std::uint8_t fp8_at(int rank, int row, int col) { return static_cast<std::uint8_t>(rank * 37 + row * 11 + col); }
std::uint32_t scale_at(int global_row, int p) { return static_cast<std::uint32_t>(global_row * 1000 + p); }

// Indices [T, K] that visit every rank's rows, out of order.
std::vector<std::int32_t> indices_for(int rank, int ranks, int T, int K) {
  std::vector<std::int32_t> idx;
  for (int i = 0; i < T * K; ++i) idx.push_back((i * 7 + rank * 5 + 3) % (ranks * kEntries));
  return idx;
}

class EngramFetch : public ::testing::TestWithParam<World> {};

TEST_P(EngramFetch, Bf16RowsAreTheWrittenRows) {
  const World w = GetParam();
  const int T = 5, K = 3;
  auto problems = testing::collect_on_ranks(w.ranks, {w.nodes}, [&](Group& g, std::vector<std::string>& out) {
    ElasticBuffer b(g, engram_config());
    std::vector<std::uint16_t> table;
    for (int e = 0; e < kEntries; ++e)
      for (int c = 0; c < kHidden; ++c) table.push_back(bf16_at(g.rank(), e, c));
    b.engram_write(TensorView(table.data(), DType::kBF16, {kEntries, kHidden}));
    auto idx = indices_for(g.rank(), w.ranks, T, K);
    const EngramFetchResult r = b.engram_fetch(TensorView(idx.data(), DType::kInt32, {T, K}));
    if (r.data.dtype() != DType::kBF16 || r.data.size(0) != T || r.data.size(1) != K * kHidden || r.sf.defined())
      return out.push_back("data is " + r.data.describe());
    const auto* got = r.data.data_as<const std::uint16_t>();
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const int gidx = idx[static_cast<size_t>(t * K + k)];
        for (int c = 0; c < kHidden; ++c)
          if (got[(t * K + k) * kHidden + c] != bf16_at(gidx / kEntries, gidx % kEntries, c))
            return out.push_back(fmt::format("row ({}, {}) = global {} differs at column {}", t, k, gidx, c));
      }
    b.barrier();
  });
  testing::report_problems(problems, {.name_rank = true});
}

TEST_P(EngramFetch, Fp8RowsAndScalesInBothLayouts) {
  const World w = GetParam();
  const int T = 6, K = 2;
  auto problems = testing::collect_on_ranks(w.ranks, {w.nodes}, [&](Group& g, std::vector<std::string>& out) {
    ElasticBuffer b(g, engram_config());
    std::vector<std::uint8_t> table;
    for (int e = 0; e < kEntries; ++e)
      for (int c = 0; c < kHidden; ++c) table.push_back(fp8_at(g.rank(), e, c));
    Tensor sf = Tensor::empty({w.ranks * kEntries, kScales}, DType::kFP32);
    for (int row = 0; row < w.ranks * kEntries; ++row)
      for (int p = 0; p < kScales; ++p) sf.data_as<std::uint32_t>()[row * kScales + p] = scale_at(row, p);
    b.engram_write(TensorView(table.data(), DType::kFP8E4M3, {kEntries, kHidden}), sf);
    auto idx = indices_for(g.rank(), w.ranks, T, K);
    for (const bool col_major : {false, true}) {
      const EngramFetchResult r = b.engram_fetch(TensorView(idx.data(), DType::kInt32, {T, K}), 0, col_major);
      if (r.data.dtype() != DType::kFP8E4M3 || r.sf.dtype() != DType::kFP32 || r.sf.size(0) != T ||
          r.sf.size(1) != K * kScales)
        return out.push_back("outputs are " + r.data.describe() + " and " + r.sf.describe());
      const std::int64_t s0 = col_major ? 1 : K * kScales, s1 = col_major ? (T + 3) / 4 * 4 : 1;
      if (r.sf.stride(0) != s0 || r.sf.stride(1) != s1) return out.push_back("sf strides: " + r.sf.describe());
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k) {
          const int gidx = idx[static_cast<size_t>(t * K + k)];
          const auto* row = r.data.data_as<const std::uint8_t>() + (t * K + k) * kHidden;
          for (int c = 0; c < kHidden; ++c)
            if (row[c] != fp8_at(gidx / kEntries, gidx % kEntries, c))
              return out.push_back(fmt::format("row ({}, {}) differs at column {}", t, k, c));
          for (int p = 0; p < kScales; ++p)
            if (r.sf.data_as<const std::uint32_t>()[t * s0 + (k * kScales + p) * s1] != scale_at(gidx, p))
              return out.push_back(fmt::format("scale ({}, {}, {}) differs (col_major {})", t, k, p, col_major));
        }
    }
    b.barrier(false, true, false);
  });
  testing::report_problems(problems, {.name_rank = true});
}

INSTANTIATE_TEST_SUITE_P(Worlds, EngramFetch, ::testing::Values(World{2, 1}, World{4, 1}, World{4, 2}),
                         [](const auto& info) { return fmt::format("r{}n{}", info.param.ranks, info.param.nodes); });

class PpRing : public ::testing::TestWithParam<World> {};

// Every rank sends D messages to next and D to prev (each 32-byte aligned, of its own length and
// contents), then receives D from prev and D from next, in each channel's order.
TEST_P(PpRing, MessagesArriveInOrderWithTheirBytes) {
  const World w = GetParam();
  const int D = 3;
  auto problems = testing::collect_on_ranks(w.ranks, {w.nodes}, [&](Group& g, std::vector<std::string>& out) {
    ElasticBuffer b(g, {.num_bytes = 2 * kMiB2, .num_cpu_timeout_secs = 30});
    b.pp_set_config(1000, D);
    const int R = w.ranks, r = g.rank(), prev = (r - 1 + R) % R, next = (r + 1) % R;
    auto message = [](int from, int to, int i) {
      std::vector<std::uint8_t> m(static_cast<size_t>(32 * (1 + (from + to + i) % 3)));
      for (size_t j = 0; j < m.size(); ++j) m[j] = static_cast<std::uint8_t>(from * 50 + to * 7 + i * 3 + j);
      return m;
    };
    for (int round = 0; round < 2; ++round) {
      for (int i = 0; i < D; ++i) {
        auto m = message(r, next, i + round);
        b.pp_send(TensorView(m.data(), DType::kUInt8, {static_cast<std::int64_t>(m.size())}), next);
        if (prev != next) {
          auto p = message(r, prev, i + round);
          b.pp_send(TensorView(p.data(), DType::kUInt8, {static_cast<std::int64_t>(p.size())}), prev);
        }
      }
      for (const int src : prev == next ? std::vector<int>{prev} : std::vector<int>{prev, next}) {
        for (int i = 0; i < D; ++i) {
          const auto want = message(src, r, i + round);
          std::vector<std::uint8_t> got(want.size());
          b.pp_recv(TensorView(got.data(), DType::kUInt8, {static_cast<std::int64_t>(got.size())}), src);
          if (got != want) out.push_back(fmt::format("message {} of round {} from rank {} differs", i, round, src));
        }
      }
      b.pp_set_config(2000, D + 1);  // nothing in flight: reconfiguring keeps the counts
    }
  });
  testing::report_problems(problems, {.name_rank = true});
}

// Even ranks send 4 D messages to their next, which receives them only after a while: the sender
// waits for credits once D are unreceived, and every message arrives intact and in order.
// Pairs of ranks: worlds of an even size.
class PpCredits : public ::testing::TestWithParam<World> {};

TEST_P(PpCredits, SendersWaitForCreditsWhenTheSlotsAreFull) {
  const World w = GetParam();
  const int D = 2, N = 4 * D;
  auto problems = testing::collect_on_ranks(w.ranks, {w.nodes}, [&](Group& g, std::vector<std::string>& out) {
    ElasticBuffer b(g, {.num_bytes = 2 * kMiB2, .num_cpu_timeout_secs = 30});
    b.pp_set_config(64, D);
    const int r = g.rank();
    std::vector<std::uint32_t> m(16);
    for (int i = 0; i < N; ++i) {
      if (r % 2 == 0) {
        for (int j = 0; j < 16; ++j) m[static_cast<size_t>(j)] = static_cast<std::uint32_t>(r * 1000 + i * 16 + j);
        b.pp_send(TensorView(m.data(), DType::kInt32, {16}), (r + 1) % w.ranks);
      } else {
        if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        b.pp_recv(TensorView(m.data(), DType::kInt32, {16}), r - 1);
        for (int j = 0; j < 16; ++j)
          if (m[static_cast<size_t>(j)] != static_cast<std::uint32_t>((r - 1) * 1000 + i * 16 + j))
            return out.push_back(fmt::format("message {} differs at {}", i, j));
      }
    }
  });
  testing::report_problems(problems, {.name_rank = true});
}

INSTANTIATE_TEST_SUITE_P(Worlds, PpRing, ::testing::Values(World{1, 1}, World{2, 1}, World{4, 1}, World{4, 2}),
                         [](const auto& info) { return fmt::format("r{}n{}", info.param.ranks, info.param.nodes); });
INSTANTIATE_TEST_SUITE_P(Worlds, PpCredits, ::testing::Values(World{2, 1}, World{4, 1}, World{4, 2}),
                         [](const auto& info) { return fmt::format("r{}n{}", info.param.ranks, info.param.nodes); });

TEST(EngramPpErrors, ArgumentsAreRefusedByName) {
  auto caught = testing::results_on_ranks<std::vector<Caught>>(4, {}, [](Group& g) {
    ElasticBuffer b(g, engram_config());
    std::vector<Caught> c;
    std::vector<std::int32_t> idx = {0, 1};
    c.push_back(catch_error([&] { b.engram_fetch(TensorView(idx.data(), DType::kInt32, {1, 2})); }));
    std::vector<std::uint16_t> table(kEntries * kHidden, 1);
    b.engram_write(TensorView(table.data(), DType::kBF16, {kEntries, kHidden}));
    idx = {0, 4 * kEntries};
    c.push_back(catch_error([&] { b.engram_fetch(TensorView(idx.data(), DType::kInt32, {1, 2})); }));
    b.pp_set_config(64, 2);
    std::vector<std::uint8_t> bytes(96);
    c.push_back(catch_error([&] { b.pp_send(TensorView(bytes.data(), DType::kUInt8, {96}), g.rank()); }));
    c.push_back(catch_error([&] { b.pp_send(TensorView(bytes.data(), DType::kUInt8, {96}), (g.rank() + 1) % 4); }));
    c.push_back(catch_error([&] { b.pp_send(TensorView(bytes.data(), DType::kUInt8, {40}), (g.rank() + 1) % 4); }));
    b.pp_send(TensorView(bytes.data(), DType::kUInt8, {32}), (g.rank() + 1) % 4);
    c.push_back(catch_error([&] { b.pp_recv(TensorView(bytes.data(), DType::kUInt8, {64}), (g.rank() + 3) % 4); }));
    b.pp_recv(TensorView(bytes.data(), DType::kUInt8, {32}), (g.rank() + 3) % 4);  // still queued
    return c;
  });
  for (int r = 0; r < 4; ++r) {
    const auto& c = caught[static_cast<size_t>(r)];
    EXPECT_EQ(c[0].type, "StateError") << c[0].message;
    EXPECT_TRUE(contains(c[0].message, "engram_write has not stored a table yet")) << c[0].message;
    EXPECT_EQ(c[1].type, "InvalidArgument");
    EXPECT_TRUE(contains(c[1].message, "indices[0, 1] = 24 is outside [0, num_ranks * num_entries = 4 * 6 = 24)"))
        << c[1].message;
    EXPECT_TRUE(contains(c[2].message, fmt::format("dst_rank_idx = {} is not a ring neighbour", r))) << c[2].message;
    EXPECT_EQ(c[3].type, "CapacityError");
    EXPECT_TRUE(contains(c[3].message, "96 bytes, more than num_max_tensor_bytes rounded up to 32 = 64")) << c[3].message;
    EXPECT_TRUE(contains(c[4].message, "40 bytes, not a multiple of 32")) << c[4].message;
    EXPECT_EQ(c[5].type, "InvalidArgument");
    EXPECT_TRUE(contains(c[5].message, fmt::format("the next message from rank {} has 32 bytes", (r + 3) % 4)))
        << c[5].message;
  }
}

TEST(EngramPpErrors, CollectiveRefusalsReachEveryRank) {
  auto caught = testing::results_on_ranks<std::vector<Caught>>(2, {}, [](Group& g) {
    std::vector<Caught> c;
    {
      ElasticBuffer plain(g, {.num_bytes = 2 * kMiB2});
      std::vector<std::uint16_t> table(kEntries * kHidden, 1);
      c.push_back(catch_error([&] { plain.engram_write(TensorView(table.data(), DType::kBF16, {kEntries, kHidden})); }));
    }
    ElasticBuffer b(g, engram_config());
    const int entries = g.rank() == 1 ? kEntries + 1 : kEntries;
    std::vector<std::uint16_t> table(static_cast<size_t>(entries * kHidden), 1);
    c.push_back(catch_error([&] { b.engram_write(TensorView(table.data(), DType::kBF16, {entries, kHidden})); }));
    c.push_back(catch_error([&] { b.pp_set_config(g.rank() == 0 ? 0 : 64, 2); }));
    c.push_back(catch_error([&] { b.pp_set_config(kMiB2, 2); }));  // 2 MiB * 2 * 4 > num_bytes
    b.barrier();  // still usable
    return c;
  });
  for (int r = 0; r < 2; ++r) {
    const auto& c = caught[static_cast<size_t>(r)];
    EXPECT_EQ(c[0].type, "InvalidArgument") << c[0].message;
    EXPECT_TRUE(contains(c[0].message, "num_cpu_bytes = 0")) << c[0].message;
    EXPECT_EQ(c[1].type, "PeerError") << c[1].message;
    EXPECT_TRUE(contains(c[1].message, "ranks disagree on num_entries (storage.size(0)): 6 on rank [0], 7 on rank [1]"))
        << c[1].message;
    EXPECT_EQ(c[2].type, r == 0 ? "InvalidArgument" : "PeerError") << c[2].message;
    EXPECT_TRUE(contains(c[3].message, "exceeds num_bytes = 4194304")) << c[3].message;
  }
}

TEST(EngramPpErrors, ConfigurationRulesOfNumCpuBytes) {
  const std::pair<ElasticBufferConfig, const char*> cases[] = {
      {{.num_cpu_bytes = kMiB2, .num_max_tokens_per_rank = 8, .hidden = 128}, "num_bytes is required"},
      {{.num_bytes = kMiB2, .num_cpu_bytes = 2 * kMiB2}, "num_cpu_bytes = 4194304 exceeds num_bytes = 2097152"},
      {{.num_bytes = 2 * kMiB2, .num_cpu_bytes = 4096}, "num_cpu_bytes = 4096 is not a multiple of 2097152"},
  };
  for (const auto& one : cases) {
    const ElasticBufferConfig& config = one.first;
    auto caught = testing::results_on_ranks<Caught>(2, {}, [&](Group& g) {
      return catch_error([&] { ElasticBuffer b(g, config); });
    });
    for (const Caught& c : caught) {
      EXPECT_EQ(c.type, "InvalidArgument") << c.message;
      EXPECT_TRUE(contains(c.message, one.second)) << c.message;
    }
  }
  // The whole of num_bytes may be storage: the pool is then empty.
  testing::results_on_ranks<int>(2, {}, [](Group& g) {
    ElasticBuffer b(g, {.num_bytes = kMiB2, .num_cpu_bytes = kMiB2});
    EXPECT_EQ(b.num_bytes(), kMiB2);
    EXPECT_EQ(b.num_cpu_bytes(), kMiB2);
    return 0;
  });
}

TEST(EngramPpErrors, CallsAfterDestroyAreStateErrors) {
  auto caught = testing::results_on_ranks<std::vector<Caught>>(2, {}, [](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 * kMiB2, .num_cpu_bytes = kMiB2, .explicitly_destroy = true});
    std::vector<std::uint16_t> table(kEntries * kHidden, 1);
    b.engram_write(TensorView(table.data(), DType::kBF16, {kEntries, kHidden}));
    b.pp_set_config(64, 2);
    b.destroy();
    std::vector<std::int32_t> idx = {0};
    std::vector<std::uint8_t> bytes(32);
    return std::vector<Caught>{
        catch_error([&] { b.engram_fetch(TensorView(idx.data(), DType::kInt32, {1, 1})); }),
        catch_error([&] { b.engram_write(TensorView(table.data(), DType::kBF16, {kEntries, kHidden})); }),
        catch_error([&] { b.pp_set_config(64, 2); }),
        catch_error([&] { b.pp_send(TensorView(bytes.data(), DType::kUInt8, {32}), 1 - g.rank()); }),
        catch_error([&] { b.pp_recv(TensorView(bytes.data(), DType::kUInt8, {32}), 1 - g.rank()); }),
        catch_error([&] { b.barrier(); })};
  });
  for (const auto& rank : caught)
    for (const Caught& c : rank) {
      EXPECT_EQ(c.type, "StateError") << c.message;
      EXPECT_TRUE(contains(c.message, "the ElasticBuffer was destroyed")) << c.message;
    }
}

TEST(EngramPpErrors, ReceiveTimeoutNamesThePeerAndClosesPp) {
  std::atomic<bool> rank0_done{false};
  auto caught = testing::results_on_ranks<std::vector<Caught>>(2, {}, [&](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 * kMiB2, .num_cpu_timeout_secs = 2});
    b.pp_set_config(64, 1);
    std::vector<Caught> c;
    std::vector<std::uint8_t> bytes(32);
    if (g.rank() == 0) {
      c.push_back(catch_error([&] { b.pp_recv(TensorView(bytes.data(), DType::kUInt8, {32}), 1); }));
      c.push_back(catch_error([&] { b.pp_send(TensorView(bytes.data(), DType::kUInt8, {32}), 1); }));
      rank0_done = true;
    } else {
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    b.barrier();  // the buffer itself stays usable
    return c;
  });
  const auto& c = caught[0];
  EXPECT_EQ(c[0].type, "TimeoutError") << c[0].message;
  EXPECT_TRUE(contains(c[0].message, "pp_recv: receive buffer empty (no message from rank 1)")) << c[0].message;
  EXPECT_EQ(c[0].ranks, std::vector<int>{1});
  EXPECT_EQ(c[1].type, "StateError") << c[1].message;
  EXPECT_TRUE(contains(c[1].message, "the PP channels were closed after a failure")) << c[1].message;
}

}  // namespace elastic_engram_pp_test
}  // namespace moe_ep
