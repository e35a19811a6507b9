// Scale-out puts straight through the MPI transport (one channel duplicated from the job's group):
// every form a record message takes lands its bytes where they were put, and nowhere else.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "comm/transport.hh"
#include "moe_ep/group.hpp"

namespace moe_ep::testing {

extern Group* g_group;  // tests/mpi/mpi_property_test.cc

namespace {

// Bytes [begin, end) of `memory` hold what rank `from` put there (want(at)), or, with from = -1,
// the 0xEE the receiver wrote before (a gap no put touched).
template <class Want>
void expect_bytes(const std::byte* memory, std::size_t begin, std::size_t end, int from, Want want_at,
                  const char* what) {
  for (std::size_t at = begin; at < end; ++at) {
    const std::byte want = from >= 0 ? want_at(at) : std::byte{0xEE};
    if (memory[at] != want) {
      ADD_FAILURE() << what << ": byte " << at << " from rank " << from << " is " << int(memory[at]) << ", expected "
                    << int(want);
      return;
    }
  }
}

// The three forms a record message takes, straight through the transport: many scattered pieces
// (at least 16 KiB: one receive into all of them), a small message (copied into place), and
// contiguous puts that become one large piece. Every byte lands where it was put; the gaps
// between pieces keep what the receiver wrote there.
TEST(MpiTransport, ScatteredContiguousAndSmallPutsLandInPlace) {
  Group& g = *g_group;
  if (g.num_scaleout() < 2) GTEST_SKIP() << "one node: no scale-out puts";
  const comm::Wait wait{"test: scattered puts", 60};
  std::unique_ptr<comm::Transport> channel = g.transport().duplicate(wait);
  constexpr std::size_t kPieces = 40, kPiece = 1000, kStride = 1536, kSmall = 5, kSmallPiece = 100;
  constexpr std::size_t kSmallAt = kPieces * kStride, kLargeAt = kSmallAt + kSmall * 2 * kSmallPiece;
  constexpr std::size_t kLarge = 64 << 10, kBytes = kLargeAt + kLarge + 4096;
  std::unique_ptr<comm::SymmetricMemory> memory = channel->allocate_symmetric(kBytes, wait);
  std::memset(memory->local(), 0xEE, kBytes);
  channel->barrier(comm::Scope::kWorld, wait);
  const int per_node = g.num_scaleup();
  const int to = (g.rank() + per_node) % g.size(), from = (g.rank() - per_node + g.size()) % g.size();
  auto byte_of = [](int source, std::size_t at) { return static_cast<std::byte>((source * 31 + at * 7 + at / 251) % 251); };
  std::vector<std::byte> src(kBytes);
  for (std::size_t i = 0; i < kBytes; ++i) src[i] = byte_of(g.rank(), i);
  for (std::size_t i = 0; i < kPieces; ++i) channel->put(to, *memory, i * kStride, &src[i * kStride], kPiece);
  channel->signal(to);
  for (std::size_t i = 0; i < kSmall; ++i)
    channel->put(to, *memory, kSmallAt + 2 * i * kSmallPiece, &src[kSmallAt + 2 * i * kSmallPiece], kSmallPiece);
  channel->signal(to);
  for (std::size_t at = 0; at < kLarge; at += 4096) channel->put(to, *memory, kLargeAt + at, &src[kLargeAt + at], 4096);
  channel->signal(to);
  const std::uint64_t three = 3;
  channel->wait_signals(std::span(&from, 1), std::span(&three, 1), wait);
  auto expect_range = [&](std::size_t begin, std::size_t end, bool written, const char* what) {
    expect_bytes(memory->local(), begin, end, written ? from : -1, [&](std::size_t at) { return byte_of(from, at); }, what);
  };
  for (std::size_t i = 0; i < kPieces; ++i) {
    expect_range(i * kStride, i * kStride + kPiece, true, "scattered piece");
    expect_range(i * kStride + kPiece, (i + 1) * kStride, false, "gap between scattered pieces");
  }
  for (std::size_t i = 0; i < kSmall; ++i) {
    expect_range(kSmallAt + 2 * i * kSmallPiece, kSmallAt + (2 * i + 1) * kSmallPiece, true, "small piece");
    expect_range(kSmallAt + (2 * i + 1) * kSmallPiece, kSmallAt + (2 * i + 2) * kSmallPiece, false, "small gap");
  }
  expect_range(kLargeAt, kLargeAt + kLarge, true, "contiguous piece");
  expect_range(kLargeAt + kLarge, kBytes, false, "after the contiguous piece");
  channel->barrier(comm::Scope::kWorld, wait);
}

// Retained puts are sent from their sources, interleaved with copied puts in one message: a
// large message (sent with a datatype over both), a small one (packed), and retained sources that
// are contiguous. A copied put's source is overwritten right after the put and a retained one right
// after finish_retained(): the receiver sees the bytes as they were when they had to be read.
TEST(MpiTransport, RetainedAndCopiedPutsLandInPlace) {
  Group& g = *g_group;
  if (g.num_scaleout() < 2) GTEST_SKIP() << "one node: no scale-out puts";
  const comm::Wait wait{"test: retained puts", 60};
  std::unique_ptr<comm::Transport> channel = g.transport().duplicate(wait);
  constexpr std::size_t kRecords = 30, kRow = 1000, kMeta = 100, kStride = 1536;  // 33 KB: large
  constexpr std::size_t kSmallAt = kRecords * kStride, kSmallRecords = 4;      // 4.4 KB: small
  constexpr std::size_t kRunAt = kSmallAt + kSmallRecords * kStride, kRun = 48 << 10, kBytes = kRunAt + kRun + 512;
  std::unique_ptr<comm::SymmetricMemory> memory = channel->allocate_symmetric(kBytes, wait);
  std::memset(memory->local(), 0xEE, kBytes);
  channel->barrier(comm::Scope::kWorld, wait);
  const int per_node = g.num_scaleup();
  const int to = (g.rank() + per_node) % g.size(), from = (g.rank() - per_node + g.size()) % g.size();
  auto byte_of = [](int source, std::size_t at) { return static_cast<std::byte>((source * 29 + at * 5 + at / 241) % 241); };
  std::vector<std::byte> src(kBytes), meta(kMeta);
  for (std::size_t i = 0; i < kBytes; ++i) src[i] = byte_of(g.rank(), i);
  auto put_records = [&](std::size_t first, std::size_t count) {
    for (std::size_t i = first; i < first + count; ++i) {
      const std::size_t at = i * kStride;
      channel->put_retained(to, *memory, at, &src[at], kRow);
      std::memcpy(meta.data(), &src[at + kRow], kMeta);  // one scratch buffer reused for every record
      channel->put(to, *memory, at + kRow, meta.data(), kMeta);
      std::memset(meta.data(), 0x55, kMeta);
    }
  };
  put_records(0, kRecords);
  channel->signal(to);
  put_records(kRecords, kSmallRecords);
  channel->signal(to);
  for (std::size_t at = 0; at < kRun; at += 4096)
    channel->put_retained(to, *memory, kRunAt + at, &src[kRunAt + at], std::min<std::size_t>(4096, kRun - at));
  channel->signal(to);
  channel->finish_retained(wait);
  std::fill(src.begin(), src.end(), std::byte{0x33});
  const std::uint64_t three = 3;
  channel->wait_signals(std::span(&from, 1), std::span(&three, 1), wait);
  auto expect_range = [&](std::size_t begin, std::size_t end, bool written, const char* what) {
    expect_bytes(memory->local(), begin, end, written ? from : -1, [&](std::size_t at) { return byte_of(from, at); }, what);
  };
  for (std::size_t i = 0; i < kRecords + kSmallRecords; ++i) {
    expect_range(i * kStride, i * kStride + kRow + kMeta, true, i < kRecords ? "large message" : "small message");
    expect_range(i * kStride + kRow + kMeta, (i + 1) * kStride, false, "gap between records");
  }
  expect_range(kRunAt, kRunAt + kRun, true, "contiguous retained run");
  expect_range(kRunAt + kRun, kBytes, false, "after the run");
  channel->barrier(comm::Scope::kWorld, wait);
}

}  // namespace
}  // namespace moe_ep::testing
