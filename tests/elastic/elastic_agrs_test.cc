// ElasticBuffer's all-gather sessions from C++ (docs/agrs.md): gathered rows against every rank's
// inputs written out in plain loops, in-place inputs, the handle's session rule, the size hints
// against their formulas, and the main misuses as typed errors on every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "support/errors.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace elastic_agrs_test {

constexpr std::int64_t kBufferBytes = std::int64_t{2} << 20;

ElasticBufferConfig config() { return {.num_bytes = kBufferBytes, .num_cpu_timeout_secs = 30}; }

std::int64_t align32(std::int64_t x) { return (x + 31) / 32 * 32; }

// Rank r's value at element i of input `which` (distinct per rank, input and element).
std::int32_t value(int rank, int which, std::int64_t i) { return rank * 100000 + which * 1000 + static_cast<std::int32_t>(i); }

std::vector<std::int32_t> input(int rank, int which, std::int64_t n) {
  std::vector<std::int32_t> v(static_cast<size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(rank, which, i);
  return v;
}

// Row j of `gathered` ([R, n] int32) holds rank j's input `which`.
void check_rows(const Tensor& gathered, int num_ranks, int which, std::int64_t n, std::vector<std::string>& problems) {
  if (gathered.dtype() != DType::kInt32 || gathered.ndim() != 2 || gathered.size(0) != num_ranks || gathered.size(1) != n) {
    problems.push_back(fmt::format("input {}: result is {}", which, gathered.describe()));
    return;
  }
  const auto* p = gathered.data_as<const std::int32_t>();
  for (int j = 0; j < num_ranks; ++j)
    for (std::int64_t i = 0; i < n; ++i)
      if (p[j * n + i] != value(j, which, i)) {
        problems.push_back(fmt::format("input {}: row {} element {} is {}, expected {}", which, j, i, p[j * n + i],
                                       value(j, which, i)));
        return;
      }
}

TEST(ElasticAgrs, GathersEveryRanksInputsInPlaceAndNot) {
  constexpr int kRanks = 4;
  const auto problems = testing::collect_on_ranks(kRanks, {}, [](Group& g, std::vector<std::string>& problems) {
    const int r = g.rank();
    ElasticBuffer buffer(g, config());
    buffer.agrs_set_config(4096, 3);
    buffer.create_agrs_session();
    auto a = input(r, 0, 5), b = input(r, 1, 16);
    const TensorView batch[] = {TensorView(a.data(), DType::kInt32, {5}), TensorView(b.data(), DType::kInt32, {16})};
    AllGatherResult first = buffer.all_gather(batch);
    // The next call's first input is in place: written where this rank's row of its block lies.
    const AgrsShape shapes[] = {{7}};
    std::vector<Tensor> place = buffer.agrs_get_inplace_tensor(shapes, DType::kInt32);
    const auto c = input(r, 2, 7);
    std::memcpy(place[0].data(), c.data(), sizeof(std::int32_t) * 7);
    const TensorView in_place[] = {place[0]};
    AllGatherResult second = buffer.all_gather(in_place);
    first.handle();
    second.handle();
    check_rows(first.gathered[0], kRanks, 0, 5, problems);
    check_rows(first.gathered[1], kRanks, 1, 16, problems);
    check_rows(second.gathered[0], kRanks, 2, 7, problems);
    // Blocks follow each other at a(bytes x R, 32); the in-place input is row r of its block.
    const auto* base = static_cast<const std::byte*>(first.gathered[0].data());
    if (static_cast<const std::byte*>(first.gathered[1].data()) != base + align32(5 * 4 * kRanks) ||
        static_cast<const std::byte*>(second.gathered[0].data()) != base + align32(5 * 4 * kRanks) + 16 * 4 * kRanks ||
        place[0].data() != static_cast<const std::byte*>(second.gathered[0].data()) + 7 * 4 * r)
      problems.push_back("the blocks are not where the session's offsets put them");
    buffer.destroy_agrs_session();
    const testing::Caught late = testing::catch_error([&] { first.handle(); });
    if (late.type != "StateError" || late.message.find("outside its session 1") == std::string::npos)
      problems.push_back("handle after the session: " + late.type + " " + late.message);
    // The next session starts from offset 0 again.
    buffer.create_agrs_session();
    AllGatherResult again = buffer.all_gather(batch);
    if (again.gathered[0].data() != first.gathered[0].data()) problems.push_back("the next session did not reuse offset 0");
    check_rows(again.gathered[1], kRanks, 1, 16, problems);
    buffer.destroy_agrs_session();
  });
  testing::report_problems(problems, {.name_rank = true});
}

TEST(ElasticAgrs, SizeHintsFollowTheFormulas) {
  testing::results_on_ranks<int>(3, {}, [](Group& g) {
    const AgrsShape shapes[] = {{32, 64, 20}, {7}, {3, 0}, {}};
    std::int64_t want = 0;
    for (const auto& s : shapes) {
      std::int64_t n = 2;  // bfloat16
      for (std::int64_t d : s) n *= d;
      want += align32(n * 3);
    }
    EXPECT_EQ(ElasticBuffer::get_agrs_num_max_session_bytes(g, shapes, DType::kBF16), want);
    EXPECT_EQ(ElasticBuffer::get_agrs_buffer_size_hint(g, 0), 0);
    EXPECT_EQ(ElasticBuffer::get_agrs_buffer_size_hint(g, 1), kBufferBytes);
    EXPECT_EQ(ElasticBuffer::get_agrs_buffer_size_hint(g, kBufferBytes + 1), 2 * kBufferBytes);
    const AgrsShape huge[] = {{INT64_MAX / 2, 3}};
    EXPECT_THROW(ElasticBuffer::get_agrs_num_max_session_bytes(g, huge, DType::kBF16), InvalidArgument);
    EXPECT_THROW(ElasticBuffer::get_agrs_buffer_size_hint(g, -1), InvalidArgument);
    return 0;
  });
}

// Each rank's outcome of `call` on a configured buffer inside an open session.
std::vector<testing::Caught> in_a_session(int ranks, const std::function<void(ElasticBuffer&, int)>& call,
                                          std::int64_t session_bytes = 4096, int calls = 2) {
  return testing::results_on_ranks<testing::Caught>(ranks, {}, [&](Group& g) {
    ElasticBuffer buffer(g, config());
    buffer.agrs_set_config(session_bytes, calls);
    buffer.create_agrs_session();
    return testing::catch_error([&] { call(buffer, g.rank()); });
  });
}

void expect_all(const std::vector<testing::Caught>& outcomes, const std::string& type, const std::string& fragment) {
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_EQ(outcomes[r].type, type) << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find(fmt::format("[rank {}]", r)), std::string::npos) << outcomes[r].message;
    EXPECT_NE(outcomes[r].message.find(fragment), std::string::npos) << outcomes[r].message;
  }
}

TEST(ElasticAgrs, MisuseIsATypedErrorOnEveryRank) {
  std::vector<std::int32_t> data(1024, 1);
  const TensorView small[] = {TensorView(data.data(), DType::kInt32, {16})};
  const TensorView big[] = {TensorView(data.data(), DType::kInt32, {1024})};
  // 1024 x 4 bytes x 2 ranks do not fit in 4096 bytes.
  expect_all(in_a_session(2, [&](ElasticBuffer& b, int) { b.all_gather(big); }), "CapacityError",
             "Not enough session buffer size. Did you forget to flush session?");
  // Q = 2 calls per session.
  expect_all(in_a_session(2, [&](ElasticBuffer& b, int) {
               b.all_gather(small);
               b.all_gather(small);
               b.all_gather(small);
             }),
             "StateError", "already made 2 all_gather calls");
  // Rank 1 gives another size: every rank raises, naming the other side.
  const auto sizes = in_a_session(3, [&](ElasticBuffer& b, int r) {
    const TensorView mine[] = {TensorView(data.data(), DType::kInt32, {r == 1 ? 8 : 16})};
    b.all_gather(mine);
  });
  expect_all(sizes, "PeerError", "ranks disagree on total input bytes");
  EXPECT_EQ(sizes[0].ranks, std::vector<int>{1});
  EXPECT_EQ(sizes[1].ranks, (std::vector<int>{0, 2}));
  expect_all(in_a_session(2, [&](ElasticBuffer& b, int) { b.all_gather({}); }), "InvalidArgument",
             "needs at least one tensor (got 0)");
  expect_all(in_a_session(2, [&](ElasticBuffer& b, int) { b.create_agrs_session(); }), "StateError",
             "session 1 is already open");
  expect_all(in_a_session(2, [&](ElasticBuffer& b, int) { b.agrs_set_config(4096, 33); }), "InvalidArgument",
             "num_max_all_gathers_per_session = 33 is outside [1, 32]");
}

TEST(ElasticAgrs, CallsNeedAConfigurationASessionAndOneNode) {
  const auto unconfigured = testing::results_on_ranks<testing::Caught>(2, {}, [](Group& g) {
    ElasticBuffer buffer(g, config());
    buffer.create_agrs_session();
    std::int32_t x[4] = {};
    const TensorView t[] = {TensorView(x, DType::kInt32, {4})};
    return testing::catch_error([&] { buffer.all_gather(t); });
  });
  expect_all(unconfigured, "StateError", "call agrs_set_config first");
  const auto no_session = testing::results_on_ranks<testing::Caught>(2, {}, [](Group& g) {
    ElasticBuffer buffer(g, config());
    buffer.agrs_set_config(4096, 2);
    return testing::catch_error([&] { buffer.destroy_agrs_session(); });
  });
  expect_all(no_session, "StateError", "no session is open");
  const auto two_nodes = testing::results_on_ranks<testing::Caught>(4, Topology{2, 0}, [](Group& g) {
    ElasticBuffer buffer(g, config());
    return testing::catch_error([&] { buffer.agrs_set_config(4096, 2); });
  });
  expect_all(two_nodes, "InvalidArgument", "the group spans 2 nodes of 2 ranks");
}

TEST(ElasticAgrs, ResultsOutliveTheBuffer) {
  const auto problems = testing::collect_on_ranks(3, {}, [](Group& g, std::vector<std::string>& problems) {
    Tensor kept;
    {
      ElasticBuffer buffer(g, config());
      buffer.agrs_set_config(4096, 2);
      buffer.create_agrs_session();
      auto a = input(g.rank(), 0, 9);
      const TensorView t[] = {TensorView(a.data(), DType::kInt32, {9})};
      kept = buffer.all_gather(t).gathered[0];
      buffer.destroy_agrs_session();
    }
    check_rows(kept, 3, 0, 9, problems);  // the region stays mapped while `kept` views it
  });
  testing::report_problems(problems, {.name_rank = true});
}

}  // namespace elastic_agrs_test
}  // namespace moe_ep
