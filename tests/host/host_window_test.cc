// Windows over the host transport (comm::Transport::share_window / node_window, engine's receive
// windows): processes of one node write into memory a peer published, only inside the spans it
// published. Every test forks its processes (tests/support/processes.hh); the bytes each process
// expects are computed here from the writers' formulas, not read back from the code under test.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "comm/transport.hh"
#include "core/host_allocator.hh"
#include "engine/receive_window.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/host.hpp"
#include "support/dev_shm.hh"
#include "support/processes.hh"

namespace moe_ep {
namespace {
// Named: the unity build puts this file beside host_transport_test.cc.
namespace window_test {

using comm::Gathered;
using comm::Scope;
using comm::Transport;
using comm::Wait;
using testing::Child;
using testing::describe;
using testing::expect_throw;
using testing::Failures;

constexpr Wait kWait{"window test", 20};
constexpr std::size_t kOut = 3 << 20;  // bytes of each rank's output window (two granules)
constexpr std::size_t kGuard = 4096;   // bytes after the published span that nobody may write

host::GroupOptions options(double timeout = 20) {
  host::GroupOptions o;
  o.ranks_per_node = 0;
  o.timeout_secs = timeout;
  return o;
}

// What writer w puts at byte j of its part of a receiver's window.
std::byte written(int w, std::size_t j) { return static_cast<std::byte>((w * 89 + j * 13 + 5) & 0xff); }
// The plan a receiver publishes (read-only for its peers): int32 entries.
std::int32_t plan_entry(int r, std::size_t i) { return static_cast<std::int32_t>(r * 1000 + i * 7); }

constexpr std::byte kUnwritten{0xEE};  // what an owner fills its memory with before peers write
// `bytes` of memfd memory, every byte kUnwritten.
std::shared_ptr<void> unwritten_block(std::size_t bytes) {
  std::shared_ptr<void> block = core::allocate_host_shared(bytes);
  std::memset(block.get(), static_cast<int>(kUnwritten), bytes);
  return block;
}
// Whether bytes [begin, end) of p are all kUnwritten.
bool unwritten(const std::byte* p, std::size_t begin, std::size_t end) {
  return std::all_of(p + begin, p + end, [](std::byte b) { return b == kUnwritten; });
}

class HostWindowTest : public testing::DevShmUnchanged {
 protected:
  void expect_all_ok(const std::vector<Child>& children) {
    for (const Child& c : children) EXPECT_TRUE(c.exited_ok()) << describe(children);
  }
};

// Every rank publishes an output window (written by its peers, in place) and a plan in plain
// memory (copied for them); each peer writes its part of every other window after reading the
// plan. The guard bytes past the published span stay as the owner set them.
std::string write_each_other(int rank, int size, const host::AllGather& ag, std::string*) {
  Failures f;
  auto group = host::make_group(rank, size, ag, options());
  Transport& t = group->transport();
  f.check(t.offers_windows(), "the host transport offers windows");
  const std::size_t part = kOut / static_cast<std::size_t>(size);
  const std::shared_ptr<void> block = unwritten_block(kOut + kGuard);
  auto* out = static_cast<std::byte*>(block.get());
  std::vector<std::int32_t> plan(1000);
  for (std::size_t i = 0; i < plan.size(); ++i) plan[i] = plan_entry(rank, i);
  const Transport::WindowSpan spans[2] = {{out, kOut, true}, {plan.data(), plan.size() * sizeof(std::int32_t), false}};
  const std::vector<Transport::PublishedSpan> mine = t.share_window(spans);
  // A span peers write must be published in place: plain memory is refused.
  const Transport::WindowSpan plain{plan.data(), 64, true};
  expect_throw<StateError>(f, "a written span in plain memory", [&] { t.share_window(std::span(&plain, 1)); }, nullptr,
                           "allocate_host_shared");
  const Gathered all = t.all_gather(std::as_bytes(std::span(mine)), Scope::kNode, kWait);
  {
    comm::PeerReads writes(t, "window test: writes");
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      const auto* theirs = reinterpret_cast<const Transport::PublishedSpan*>(all[q].data());
      const auto* their_plan = reinterpret_cast<const std::int32_t*>(t.node_window(q, theirs[1], 4000));
      bool plan_ok = true;
      for (std::size_t i = 0; i < 1000; ++i) plan_ok = plan_ok && their_plan[i] == plan_entry(q, i);
      f.check(plan_ok, "the plan of rank " + std::to_string(q) + " reads as published");
      std::byte* dst = t.node_window(q, theirs[0], kOut);
      for (std::size_t j = 0; j < part; ++j) dst[static_cast<std::size_t>(rank) * part + j] = written(rank, j);
      // Past the published span: refused, nothing mapped for it.
      expect_throw<StateError>(f, "a span longer than published", [&] { t.node_window(q, theirs[0], kOut + 1); },
                               nullptr, "published a span of");
    }
  }
  t.barrier(Scope::kNode, kWait);  // every write landed
  for (int w = 0; w < size; ++w) {
    if (w == rank) continue;
    bool ok = true;
    for (std::size_t j = 0; j < part && ok; ++j) ok = out[static_cast<std::size_t>(w) * part + j] == written(w, j);
    f.check(ok, "the part rank " + std::to_string(w) + " wrote");
  }
  f.check(unwritten(out, kOut, kOut + kGuard), "the guard bytes after the window");
  t.barrier(Scope::kNode, kWait);
  return f.str();
}

TEST_F(HostWindowTest, ProcessesWriteIntoEachOthersWindows) {
  expect_all_ok(testing::run_processes(3, write_each_other));
}

// A receiver whose output is smaller than its row count claims: the source refuses to open it
// (StateError naming the receiver) and writes nothing, not even inside the span.
std::string short_output(int rank, int size, const host::AllGather& ag, std::string*) {
  Failures f;
  auto group = host::make_group(rank, size, ag, options());
  Transport& t = group->transport();
  constexpr std::int64_t kRowBytes = 256, kRows = 8, kClaimed = 64;
  const std::size_t bytes = kRows * kRowBytes + kGuard;
  const std::shared_ptr<void> block = unwritten_block(bytes);
  auto* out = static_cast<std::byte*>(block.get());
  engine::WindowOutputs w;
  w.x = out;
  engine::WindowShape shape{.row_bytes = kRowBytes, .topk = 1, .scale_columns = 0, .max_tokens = 64};
  std::shared_ptr<void> ids_block = core::allocate_host_shared(static_cast<std::size_t>(kClaimed) * 8);
  w.ids = static_cast<std::int64_t*>(ids_block.get());
  w.out_rows = kRows;  // what it allocated
  engine::PublishedWindow mine = engine::publish_window(t, w, shape);
  if (rank == 0) mine.out_rows = kClaimed;  // claims more rows than its x span holds
  const Gathered all = t.all_gather(std::as_bytes(std::span(&mine, 1)), Scope::kNode, kWait);
  if (rank == 1) {
    comm::PeerReads writes(t, "window test: short output");
    engine::PublishedWindow theirs;
    std::memcpy(&theirs, all[0].data(), sizeof theirs);
    expect_throw<StateError>(f, "opening a window whose x is smaller than its rows", [&] {
      engine::open_window(t, 0, theirs, shape);
    }, nullptr, "window of rank 0");
  }
  t.barrier(Scope::kNode, kWait);
  f.check(unwritten(out, 0, bytes), "no byte of the short window (or after it) was written");
  return f.str();
}

TEST_F(HostWindowTest, SourceRefusesAReceiverWhoseOutputIsSmallerThanItsPlan) {
  expect_all_ok(testing::run_processes(2, short_output));
}

// A source dies in the middle of its writes: the receiver's wait names it (PeerError), the bytes
// it wrote lie inside the window, and the guard after the window is untouched.
std::string dies_mid_push(int rank, int size, const host::AllGather& ag, std::string*) {
  Failures f;
  auto group = host::make_group(rank, size, ag, options());
  Transport& t = group->transport();
  const std::shared_ptr<void> block = unwritten_block(kOut + kGuard);
  auto* out = static_cast<std::byte*>(block.get());
  const Transport::WindowSpan span{out, kOut, true};
  const std::vector<Transport::PublishedSpan> mine = t.share_window(std::span(&span, 1));
  const Gathered all = t.all_gather(std::as_bytes(std::span(mine)), Scope::kNode, kWait);
  if (rank == 1) {
    comm::PeerReads writes(t, "window test: dying source");
    std::byte* dst = t.node_window(0, *reinterpret_cast<const Transport::PublishedSpan*>(all[0].data()), kOut);
    for (std::size_t j = 0; j < kOut / 2; ++j) dst[j] = written(1, j);
    raise(SIGKILL);
  }
  const std::vector<int> expected{1};
  expect_throw<PeerError>(f, "the exit barrier", [&] { t.barrier(Scope::kNode, kWait); }, &expected, "left");
  f.check(unwritten(out, kOut, kOut + kGuard), "the guard bytes after the window");
  bool inside = true;  // each byte is either the owner's or what the source wrote there
  for (std::size_t j = 0; j < kOut && inside; ++j) inside = out[j] == kUnwritten || out[j] == written(1, j);
  f.check(inside, "the window holds only the owner's bytes and the source's writes");
  return f.str();
}

TEST_F(HostWindowTest, SourceDyingMidPushIsNamedAndWroteOnlyInsideTheWindow) {
  const auto children = testing::run_processes(2, dies_mid_push);
  EXPECT_TRUE(WIFSIGNALED(children[1].status));
  EXPECT_TRUE(children[0].exited_ok()) << describe(children);
}

}  // namespace window_test
}  // namespace
}  // namespace moe_ep
