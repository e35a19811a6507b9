// Memory bandwidth (core/bandwidth.hh): how MemoryBandwidth prices a byte read and a byte written
// and how much memory a probe maps for a count of threads (expected values worked out by hand
// from the rules in the header), and that each measured pass returns a rate.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/bandwidth.hh"

namespace moe_ep::core {
namespace bandwidth_test {

// 1 / (x GB/s) in seconds per byte.
constexpr double per_byte(double gbs) { return 1.0 / (gbs * 1e9); }

TEST(MemoryBandwidth, AByteWrittenCostsTheCopyLessItsReadsWithoutAWritePass) {
  const MemoryBandwidth m{.copy_gbs = 10, .read_gbs = 20, .write_gbs = 0};
  ASSERT_TRUE(m.usable());
  EXPECT_DOUBLE_EQ(m.seconds_per_read_byte(), per_byte(20));
  // 0.1 ns per byte copied, 0.05 of it reading: 0.05 ns per byte written.
  EXPECT_DOUBLE_EQ(m.seconds_per_written_byte(), 0.05e-9);
  // 1 GB read (0.05 s) and 2 GB written (0.1 s).
  EXPECT_DOUBLE_EQ(m.floor_seconds(1e9, 2e9), 0.15);
}

TEST(MemoryBandwidth, AByteWrittenCostsTheCheaperOfTheCopyAndTheWritePass) {
  // Writes alone at 40 GB/s (0.025 ns) are cheaper than the copy's 0.05 ns per byte written.
  const MemoryBandwidth fast_writes{.copy_gbs = 10, .read_gbs = 20, .write_gbs = 40};
  EXPECT_DOUBLE_EQ(fast_writes.seconds_per_written_byte(), 0.025e-9);
  EXPECT_DOUBLE_EQ(fast_writes.floor_seconds(1e9, 2e9), 0.1);
  // Writes alone at 5 GB/s (0.2 ns): the copy's price stands.
  const MemoryBandwidth slow_writes{.copy_gbs = 10, .read_gbs = 20, .write_gbs = 5};
  EXPECT_DOUBLE_EQ(slow_writes.seconds_per_written_byte(), 0.05e-9);
}

TEST(MemoryBandwidth, MeasurementsThatMakeNoCostAreNotUsable) {
  EXPECT_FALSE((MemoryBandwidth{.copy_gbs = 0, .read_gbs = 20, .write_gbs = 30}.usable()));
  EXPECT_FALSE((MemoryBandwidth{.copy_gbs = 20, .read_gbs = 20, .write_gbs = 30}.usable()));  // copy as fast as reading
  EXPECT_FALSE((MemoryBandwidth{.copy_gbs = 10, .read_gbs = 20, .write_gbs = -1}.usable()));
  EXPECT_FALSE(MemoryBandwidth{}.usable());
}

constexpr std::size_t kKiB = std::size_t{1} << 10, kMiB = std::size_t{1} << 20;
constexpr std::uint64_t kGiB = std::uint64_t{1} << 30, kPlenty = std::uint64_t{1} << 50;

TEST(ProbeSizing, FewThreadsGetWhatTheyWant) {
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 1, kPlenty), 64 * kMiB);
  // 32 threads x 2 buffers x 64 MiB = 4 GiB: the whole budget.
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 32, kPlenty), 64 * kMiB);
  // A smaller wish stands (a shape whose traffic fits the caches).
  EXPECT_EQ(probe_bytes_per_thread(512 * kKiB, 8, kPlenty), 512 * kKiB);
}

TEST(ProbeSizing, MoreThreadsShareTheBudget) {
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 64, kPlenty), 32 * kMiB);  // 4 GiB / 128 buffers
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 1024, kPlenty), 2 * kMiB);  // 4 GiB / 2048 buffers
  // 4 GiB / 8192 buffers would be 512 KiB: the 1 MiB minimum holds (8 GiB in all).
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 4096, kPlenty), 1 * kMiB);
}

TEST(ProbeSizing, NeverMoreThanAQuarterOfTheAvailableMemory) {
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 16, 1 * kGiB), 8 * kMiB);  // 256 MiB / 32 buffers
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 1024, 16 * kGiB), 2 * kMiB);  // the budget is smaller
  // 512 MiB / 2048 buffers = 256 KiB: below the minimum, the machine wins.
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 1024, 2 * kGiB), 256 * kKiB);
  // 256 MiB / 6 buffers = 44739242 bytes, rounded down to 4096: 10922 pages.
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 3, 1 * kGiB), std::size_t{10922} * 4096);
  // Nothing available: one page each.
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 1024, 0), 4096u);
  // A thread count below 1 counts as 1.
  EXPECT_EQ(probe_bytes_per_thread(64 * kMiB, 0, 1 * kGiB), 64 * kMiB);
}

TEST(ProbeSizing, ThisMachineHasMemoryToOffer) {
  EXPECT_GT(available_memory_bytes(1), 0u);
  const std::size_t bytes = probe_bytes(64 * kMiB, 4);
  EXPECT_GE(bytes, 4096u);
  EXPECT_LE(bytes, 64 * kMiB);
  EXPECT_EQ(bytes % 4096, 0u);
}

TEST(MemoryBandwidth, EveryPassMeasuresARate) {
  // Two threads, 1 MiB each, one repetition: a failed pass returns 0.
  EXPECT_GT(measure_copy_bandwidth(2, std::size_t{1} << 20, 1), 0.0);
  EXPECT_GT(measure_streaming_copy_bandwidth(2, std::size_t{1} << 20, 1), 0.0);
  EXPECT_GT(measure_read_bandwidth(2, std::size_t{1} << 20, 1), 0.0);
  EXPECT_GT(measure_write_bandwidth(2, std::size_t{1} << 20, 1), 0.0);
  // Sizes that are not a multiple of the vector width.
  EXPECT_GT(measure_write_bandwidth(1, 1000, 1), 0.0);
  EXPECT_GT(measure_read_bandwidth(1, 1000, 1), 0.0);
}

}  // namespace bandwidth_test
}  // namespace moe_ep::core
