// The host transport (include/moe_ep/host.hpp): every test forks N processes that bootstrap
// through an all-gather served by this process (tests/support/processes.hh), run a scenario and
// report by exit code, with their failures written to a result pipe. Expected values are computed here independently; the elastic
// case compares with the in-process transport (LocalWorld) on the same inputs. After every test,
// /dev/shm holds what it held before.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "comm/transport.hh"
#include "support/dev_shm.hh"
#include "support/elastic_harness.hh"
#include "support/processes.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/host.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {
namespace {

using comm::Gathered;
using comm::Scope;
using comm::Transport;
using comm::Wait;
using testing::Body;
using testing::Child;
using testing::describe;
using testing::expect_throw;
using testing::Failures;
using testing::ranks_text;
using testing::Rewrite;
using testing::run_processes;

host::GroupOptions options(int ranks_per_node, double timeout = 10) {
  host::GroupOptions o;
  o.ranks_per_node = ranks_per_node;
  o.timeout_secs = timeout;
  return o;
}

constexpr Wait kWait{"host test", 10};

// The byte j of rank r's block in round i (of channel c).
std::byte pattern(int r, int i, std::size_t j, int c = 0) {
  return static_cast<std::byte>((r * 131 + i * 17 + static_cast<int>(j) * 7 + c * 53) & 0xff);
}

std::size_t block_bytes(int r, int i) {
  return static_cast<std::size_t>((r * 37 + i * 13) % 300) + (i % 7 == 3 ? 70000u * static_cast<unsigned>(r + 1) : 0u);
}

std::vector<std::byte> make_block(int r, int i, int c = 0) {
  std::vector<std::byte> b(block_bytes(r, i));
  for (std::size_t j = 0; j < b.size(); ++j) b[j] = pattern(r, i, j, c);
  return b;
}

void check_gathered(Failures& f, const Gathered& g, int first, int members, int round, int channel,
                    const std::string& what) {
  f.check(g.size() == members, what + ": " + std::to_string(g.size()) + " blocks");
  for (int m = 0; m < std::min(members, g.size()); ++m) {
    const auto expected = make_block(first + m, round, channel);
    const bool same = g[m].size() == expected.size() && std::equal(expected.begin(), expected.end(), g[m].begin());
    f.check(same, what + ": block of rank " + std::to_string(first + m) + " (" + std::to_string(g[m].size()) +
                      " bytes, expected " + std::to_string(expected.size()) + ")");
  }
}

// ---- Every test leaves /dev/shm as it found it ----------------------------------------------

class HostTransportTest : public testing::DevShmUnchanged {
 protected:
  void expect_all_ok(const std::vector<Child>& children) {
    for (const Child& c : children) EXPECT_TRUE(c.exited_ok()) << describe(children);
  }
};

// ---- Collectives ----------------------------------------------------------------------------

std::string collectives(int rank, int size, const host::AllGather& ag, int rpn) {
  Failures f;
  auto group = host::make_group(rank, size, ag, options(rpn));
  Transport& t = group->transport();
  const int per_node = rpn == 0 ? size : rpn;
  f.check(group->size() == size && group->num_scaleup() == per_node && group->num_scaleout() == size / per_node,
          "topology");
  f.check(t.ranks_on_host() == size, "ranks_on_host");
  for (int i = 0; i < 40; ++i) {
    const auto mine = make_block(rank, i);
    const Gathered world = t.all_gather(mine, Scope::kWorld, kWait);
    check_gathered(f, world, 0, size, i, 0, "world round " + std::to_string(i));
    const auto node_mine = make_block(rank, i + 1000);
    const Gathered node = t.all_gather(node_mine, Scope::kNode, kWait);
    check_gathered(f, node, t.node_first_rank(), per_node, i + 1000, 0, "node round " + std::to_string(i));
    // The world blocks stay valid until the next world collective.
    check_gathered(f, world, 0, size, i, 0, "world round " + std::to_string(i) + " after a node collective");
    if (i % 5 == 0) t.barrier(Scope::kWorld, kWait);
    if (i % 3 == 0) t.barrier(Scope::kNode, kWait);
  }
  // A duplicated channel has its own sequence: a different number of collectives on each.
  auto dup = t.duplicate(kWait);
  f.check(dup->rank() == rank && dup->size() == size, "duplicate: rank and size");
  for (int i = 0; i < 6; ++i) {
    const auto mine = make_block(rank, i, 1);
    check_gathered(f, dup->all_gather(mine, Scope::kWorld, kWait), 0, size, i, 1, "dup round " + std::to_string(i));
    if (i % 2 == 0) {
      const auto other = make_block(rank, 100 + i);
      check_gathered(f, t.all_gather(other, Scope::kWorld, kWait), 0, size, 100 + i, 0,
                     "parent after dup round " + std::to_string(i));
    }
  }
  dup->barrier(Scope::kNode, kWait);
  dup.reset();
  group->barrier(10);
  return f.str();
}

TEST_F(HostTransportTest, CollectivesTwoProcesses) {
  expect_all_ok(run_processes(2, [](int r, int n, const host::AllGather& ag, std::string*) { return collectives(r, n, ag, 0); }));
}

TEST_F(HostTransportTest, CollectivesFourProcesses) {
  expect_all_ok(run_processes(4, [](int r, int n, const host::AllGather& ag, std::string*) { return collectives(r, n, ag, 0); }));
}

TEST_F(HostTransportTest, CollectivesTwoLogicalNodesOfTwo) {
  expect_all_ok(run_processes(4, [](int r, int n, const host::AllGather& ag, std::string*) { return collectives(r, n, ag, 2); }));
}

TEST_F(HostTransportTest, RejectsRankOutOfRangeBeforeTheGather) {
  int calls = 0;
  host::AllGather ag = [&](const std::string&) {
    ++calls;
    return std::vector<std::string>{};
  };
  EXPECT_THROW(host::make_group(2, 2, ag), InvalidArgument);
  EXPECT_THROW(host::make_group(-1, 2, ag), InvalidArgument);
  EXPECT_THROW(host::make_group(0, 0, ag), InvalidArgument);
  EXPECT_EQ(calls, 0);
}

// ---- Symmetric memory -----------------------------------------------------------------------

constexpr std::size_t kStride = 4096;
constexpr std::size_t kPut = 64;

std::byte put_byte(int from, int to, std::size_t j) { return static_cast<std::byte>((from * 29 + to * 11 + j) & 0xff); }

std::string symmetric(int rank, int size, const host::AllGather& ag, int rpn) {
  Failures f;
  auto group = host::make_group(rank, size, ag, options(rpn));
  Transport& t = group->transport();
  auto memory = t.allocate_symmetric(kStride * static_cast<std::size_t>(size), kWait);
  f.check(memory->bytes() == kStride * static_cast<std::size_t>(size), "bytes()");
  f.check(std::all_of(memory->local(), memory->local() + memory->bytes(), [](std::byte b) { return b == std::byte{0}; }),
          "symmetric memory starts zeroed");
  t.barrier(Scope::kWorld, kWait);  // everyone looked before anyone puts
  const std::uint64_t sent = t.scaleout_bytes_sent();
  // Every rank puts its bytes into every rank (other logical nodes included), then signals it.
  for (int to = 0; to < size; ++to) {
    std::byte data[kPut];
    for (std::size_t j = 0; j < kPut; ++j) data[j] = put_byte(rank, to, j);
    t.put(to, *memory, static_cast<std::size_t>(rank) * kStride, data, kPut);
    t.signal(to);
  }
  std::vector<int> peers;
  std::vector<std::uint64_t> targets;
  for (int r = 0; r < size; ++r) peers.push_back(r), targets.push_back(1);
  t.wait_signals(peers, targets, kWait);
  for (int from = 0; from < size; ++from)
    for (std::size_t j = 0; j < kPut; ++j)
      if (memory->local()[static_cast<std::size_t>(from) * kStride + j] != put_byte(from, rank, j)) {
        f.check(false, "bytes put by rank " + std::to_string(from));
        break;
      }
  f.check(t.scaleout_bytes_sent() - sent == kPut * static_cast<std::size_t>(size), "scaleout_bytes_sent");
  // Node peers read each other's memory directly: what this rank put there.
  t.barrier(Scope::kWorld, kWait);
  for (int q = t.node_first_rank(); q < t.node_first_rank() + t.node_size(); ++q) {
    const std::byte* theirs = memory->node_peer(q) + static_cast<std::size_t>(rank) * kStride;
    for (std::size_t j = 0; j < kPut; ++j)
      if (theirs[j] != put_byte(rank, q, j)) {
        f.check(false, "node_peer(" + std::to_string(q) + ") reads other bytes");
        break;
      }
  }
  if (t.node_size() < size) {
    const int other = (t.node_first_rank() + t.node_size()) % size;
    expect_throw<StateError>(f, "node_peer of another node", [&] { memory->node_peer(other); });
  }
  // Second round of signals: counters are monotonic.
  t.barrier(Scope::kWorld, kWait);
  for (int to = 0; to < size; ++to) t.signal(to);
  for (auto& x : targets) x = 2;
  t.wait_signals(peers, targets, kWait);
  // A size mismatch names the rank that differs.
  const std::vector<int> expected = rank == 1 ? [&] {
    std::vector<int> v;
    for (int r = 0; r < size; ++r)
      if (r != 1) v.push_back(r);
    return v;
  }()
                                              : std::vector<int>{1};
  expect_throw<PeerError>(
      f, "size mismatch", [&] { t.allocate_symmetric(rank == 1 ? 8192 : 4096, kWait); }, &expected,
      "symmetric allocation: ranks disagree on the size: 4096 bytes on ");
  group->barrier(10);  // still in step
  memory.reset();
  return f.str();
}

TEST_F(HostTransportTest, SymmetricMemoryTwoProcesses) {
  expect_all_ok(run_processes(2, [](int r, int n, const host::AllGather& ag, std::string*) { return symmetric(r, n, ag, 0); }));
}

TEST_F(HostTransportTest, SymmetricMemoryTwoLogicalNodesOfTwo) {
  expect_all_ok(run_processes(4, [](int r, int n, const host::AllGather& ag, std::string*) { return symmetric(r, n, ag, 2); }));
}

// ---- share() --------------------------------------------------------------------------------

std::byte share_byte(int r, std::size_t j, int kind) { return static_cast<std::byte>((r * 71 + j * 3 + kind * 101) & 0xff); }

std::string shared(int rank, int size, const host::AllGather& ag) {
  Failures f;
  auto group = host::make_group(rank, size, ag, options(0));
  Transport& t = group->transport();
  constexpr std::size_t kPlain = 64 * 100;
  std::byte* plain = static_cast<std::byte*>(std::malloc(kPlain));
  for (std::size_t j = 0; j < kPlain; ++j) plain[j] = share_byte(rank, j, 0);
  Tensor tensor = Tensor::empty({std::int64_t{2} << 20}, DType::kUInt8);  // a memfd block (make_group came first)
  auto* tdata = static_cast<std::byte*>(tensor.data());
  for (std::size_t j = 0; j < tensor.nbytes(); ++j) tdata[j] = share_byte(rank, j, 1);

  const std::uint64_t copied0 = t.shared_bytes_copied();
  const Transport::Span plain_span{plain, kPlain};
  const auto plain_pub = t.share(std::span(&plain_span, 1));
  f.check(t.shared_bytes_copied() - copied0 == kPlain,
          "a malloc'd buffer is copied: shared_bytes_copied grew by " + std::to_string(t.shared_bytes_copied() - copied0));
  const std::uint64_t copied1 = t.shared_bytes_copied();
  const Transport::Span spans[2] = {{plain, kPlain}, {tdata + 4096, tensor.nbytes() - 4096}};
  const auto pub = t.share(spans);
  f.check(t.shared_bytes_copied() - copied1 == kPlain, "the tensor block is shared in place: shared_bytes_copied grew by " +
                                                           std::to_string(t.shared_bytes_copied() - copied1));
  const std::uintptr_t mine[2] = {reinterpret_cast<std::uintptr_t>(pub[0]), reinterpret_cast<std::uintptr_t>(pub[1])};
  const Gathered all = t.all_gather(std::as_bytes(std::span(mine)), Scope::kNode, kWait);
  {
    comm::PeerReads reads(t, "host test: reads");
    for (int m = 0; m < t.node_size(); ++m) {
      const int q = t.node_first_rank() + m;
      const auto* p = static_cast<const std::byte*>(t.node_address(q, reinterpret_cast<const void*>(all.as<std::uintptr_t[2]>(m)[0])));
      bool same = true;
      for (std::size_t j = 0; j < kPlain && same; ++j) same = p[j] == share_byte(q, j, 0);
      f.check(same, "the copy shared by rank " + std::to_string(q));
      const auto* b = static_cast<const std::byte*>(t.node_address(q, reinterpret_cast<const void*>(all.as<std::uintptr_t[2]>(m)[1])));
      same = true;
      for (std::size_t j = 0; j < tensor.nbytes() - 4096 && same; j += 997) same = b[j] == share_byte(q, j + 4096, 1);
      f.check(same, "the tensor shared in place by rank " + std::to_string(q));
    }
  }
  t.barrier(Scope::kNode, kWait);  // peers are done reading before anything is freed
  std::free(plain);
  return f.str();
}

TEST_F(HostTransportTest, ShareCopiesPlainMemoryAndMapsTensorsInPlace) {
  expect_all_ok(run_processes(2, [](int r, int n, const host::AllGather& ag, std::string*) { return shared(r, n, ag); }));
}

// ---- ElasticBuffer: the same outputs as the in-process transport -----------------------------

reference::CaseSpec elastic_spec(int ranks, int scaleout, int variant) {
  reference::CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.allow_hybrid = variant & 1;
  s.expand = variant & 2;
  s.fp8 = variant & 4;
  s.multi = true;
  s.num_experts = ranks * 3;
  s.k = 4;
  s.max_tokens = 12;
  s.hidden = 128;
  s.scale_cols = s.fp8 ? 1 : 0;
  s.seed = 700 + static_cast<std::uint64_t>(variant);
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r % 3 == 1 ? 3 : 12 - r % 5);
  return s;
}

constexpr int kVariants[] = {1, 6};

void elastic_matches_local(int rpn, const std::vector<Child>& children) {
  const int size = 4;
  const int scaleout = size / rpn;
  for (const Child& c : children) ASSERT_TRUE(c.exited_ok()) << describe(children);
  for (std::size_t v = 0; v < std::size(kVariants); ++v) {
    const auto spec = elastic_spec(size, scaleout, kVariants[v]);
    const std::vector<std::uint64_t> expected = testing::in_process_digests(spec, {});
    for (int r = 0; r < size; ++r) {
      std::istringstream in(children[static_cast<size_t>(r)].output);
      std::vector<std::uint64_t> digests;
      for (std::uint64_t d; in >> d;) digests.push_back(d);
      ASSERT_EQ(digests.size(), std::size(kVariants)) << "rank " << r;
      EXPECT_EQ(digests[v], expected[static_cast<size_t>(r)])
          << "rank " << r << ", variant " << kVariants[v] << ": outputs differ from the in-process transport's";
    }
  }
}

Body elastic_body(int rpn) {
  return [rpn](int rank, int size, const host::AllGather& ag, std::string* output) {
    auto group = host::make_group(rank, size, ag, options(rpn, 30));
    std::string failures;
    for (int variant : kVariants) {
      const auto spec = elastic_spec(size, group->num_scaleout(), variant);
      std::uint64_t digest = 0;
      testing::RunOptions o;
      o.digest = &digest;
      for (const auto& f : testing::run_elastic_case(*group, spec, o)) failures += f + "; ";
      *output += std::to_string(digest) + " ";
    }
    return failures;
  };
}

TEST_F(HostTransportTest, ElasticOneNodeOfFourMatchesInProcess) { elastic_matches_local(4, run_processes(4, elastic_body(4))); }

TEST_F(HostTransportTest, ElasticTwoNodesOfTwoMatchesInProcess) { elastic_matches_local(2, run_processes(4, elastic_body(2))); }

// ---- Failures -------------------------------------------------------------------------------

// Rank `victim` leaves right after make_group (exit or SIGKILL); the others wait for it with a
// 20 s timeout and must learn that it left, naming it.
Body leaving_body(int victim, bool kill_it) {
  return [=](int rank, int size, const host::AllGather& ag, std::string*) -> std::string {
    auto group = host::make_group(rank, size, ag, options(2, 20));
    // Every rank has finished its set-up before the victim goes: its departure is then met in the
    // barrier below, never in a peer's make_group.
    group->barrier(20);
    if (rank == victim) {
      if (kill_it) raise(SIGKILL);
      _exit(0);
    }
    Failures f;
    const std::vector<int> expected{victim};
    try {
      group->barrier(20);
      f.check(false, "the barrier completed without rank " + std::to_string(victim));
    } catch (const TimeoutError& e) {
      f.check(false, std::string("timed out instead of naming the departure: ") + e.what());
    } catch (const PeerError& e) {
      f.check(e.ranks() == expected, "names ranks " + ranks_text(e.ranks()));
      f.check(std::string(e.what()).find("left") != std::string::npos, std::string("message: ") + e.what());
    }
    return f.str();
  };
}

void expect_survivors_ok(const std::vector<Child>& children, int victim) {
  for (int r = 0; r < static_cast<int>(children.size()); ++r)
    if (r != victim) {
      EXPECT_TRUE(children[static_cast<size_t>(r)].exited_ok()) << describe(children);
    }
}

TEST_F(HostTransportTest, ExitedProcessIsNamed) { expect_survivors_ok(run_processes(4, leaving_body(2, false)), 2); }

TEST_F(HostTransportTest, KilledProcessIsNamed) {
  const auto children = run_processes(4, leaving_body(1, true));
  EXPECT_TRUE(WIFSIGNALED(children[1].status));
  expect_survivors_ok(children, 1);
}

// A killed peer is named in a wait for signals too.
TEST_F(HostTransportTest, KilledProcessIsNamedInSignalWait) {
  expect_survivors_ok(run_processes(2,
                                    [](int rank, int size, const host::AllGather& ag, std::string*) -> std::string {
                                      auto group = host::make_group(rank, size, ag, options(1, 20));
                                      Transport& t = group->transport();
                                      group->barrier(20);  // both set up before rank 0 goes
                                      if (rank == 0) raise(SIGKILL);
                                      Failures f;
                                      const int peer = 0;
                                      const std::uint64_t target = 1;
                                      const std::vector<int> expected{0};
                                      expect_throw<PeerError>(
                                          f, "wait_signals",
                                          [&] { t.wait_signals(std::span(&peer, 1), std::span(&target, 1), {"test signals", 20}); },
                                          &expected, "left");
                                      // This rank left the channel: its collectives are refused.
                                      expect_throw<StateError>(f, "collective after leaving", [&] { t.barrier(Scope::kWorld, kWait); });
                                      return f.str();
                                    }),
                      0);
}

TEST_F(HostTransportTest, AbsentRankTimesOut) {
  const int victim = 3;
  expect_survivors_ok(run_processes(4,
                                    [=](int rank, int size, const host::AllGather& ag, std::string*) -> std::string {
                                      auto group = host::make_group(rank, size, ag, options(0, 10));
                                      if (rank == victim) {
                                        sleep(2);  // stays, never calls
                                        _exit(0);
                                      }
                                      Failures f;
                                      const std::vector<int> expected{victim};
                                      expect_throw<TimeoutError>(f, "barrier", [&] { group->barrier(1.0); }, &expected,
                                                                 "timed out");
                                      return f.str();
                                    }),
                      victim);
}

// make_group refusing what the blocks say: every rank gets the same error.
template <class E>
void expect_make_group_refused(int size, const std::function<int(int)>& rpn_of, const Rewrite& rewrite,
                               const std::function<std::vector<int>(int)>& ranks_of, const std::string& needle) {
  const auto children = run_processes(
      size,
      [&](int rank, int n, const host::AllGather& ag, std::string*) {
        Failures f;
        const std::vector<int> ranks = ranks_of ? ranks_of(rank) : std::vector<int>{};
        expect_throw<E>(f, "make_group", [&] { host::make_group(rank, n, ag, options(rpn_of(rank), 5)); },
                        ranks_of ? &ranks : nullptr, needle);
        return f.str();
      },
      rewrite);
  for (const Child& c : children) EXPECT_TRUE(c.exited_ok()) << describe(children);
}

TEST_F(HostTransportTest, RanksPerNodeNotDividingSize) {
  expect_make_group_refused<InvalidArgument>(4, [](int) { return 3; }, {}, {}, "ranks_per_node = 3");
}

TEST_F(HostTransportTest, NegativeRanksPerNode) {
  expect_make_group_refused<InvalidArgument>(2, [](int) { return -1; }, {}, {}, "ranks_per_node = -1");
}

TEST_F(HostTransportTest, DisagreeingRanksPerNode) {
  expect_make_group_refused<PeerError>(
      4, [](int r) { return r == 3 ? 2 : 4; }, {},
      [](int r) { return r == 3 ? std::vector<int>{0, 1, 2} : std::vector<int>{3}; }, "disagree on ranks_per_node");
}

TEST_F(HostTransportTest, ProcessesOnDifferentHosts) {
  expect_make_group_refused<InvalidArgument>(
      4, [](int) { return 0; },
      [](std::vector<std::string>& blocks) {
        auto j = nlohmann::json::parse(blocks[1]);
        j["hostname"] = "elsewhere-host";
        blocks[1] = j.dump();
      },
      {}, "elsewhere-host");
}

TEST_F(HostTransportTest, WrongBlockCount) {
  expect_make_group_refused<StateError>(2, [](int) { return 0; }, [](std::vector<std::string>& b) { b.pop_back(); }, {},
                                        "1 blocks");
}

TEST_F(HostTransportTest, BlockNotWrittenByMakeGroup) {
  expect_make_group_refused<StateError>(2, [](int) { return 0; }, [](std::vector<std::string>& b) { b[0] = "hello"; },
                                        {}, "not a host bootstrap record");
}

}  // namespace
}  // namespace moe_ep
