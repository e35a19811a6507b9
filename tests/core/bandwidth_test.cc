// Memory bandwidth (core/bandwidth.hh): how MemoryBandwidth prices a byte read and a byte written
// (expected values worked out by hand from the rule in the header), and that each measured pass
// returns a rate.
#include <gtest/gtest.h>

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
