// Memory bandwidth measurements: the memcpy ceiling that benchmarks report against, and the
// inputs of the worker-count model.
//
// measure_copy_bandwidth runs `threads` threads, each copying its own pre-faulted buffer of
// `bytes_per_thread` bytes (source and destination distinct), `repetitions` times after one
// warm-up pass, all threads starting together; it returns payload bytes copied per second
// (GB/s, 1e9) over the best repetition's wall time. Buffers larger than the last-level cache
// measure DRAM; smaller ones measure caches. A thread the system does not start is a
// ResourceError naming the probe and the thread count, raised after the threads already started
// have been joined (core::start_thread).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace moe_ep::core {

double measure_copy_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions = 3);
// The same with non-temporal stores (core::copy_bytes_streaming): the destination is written
// without being read into the cache first, as the data paths write their outputs.
double measure_streaming_copy_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions = 3);
// The same with every thread only reading its buffer (a vector load of every byte, the loaded
// values folded so that the loads cannot be dropped): bytes read per second.
double measure_read_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions = 3);
// The same with every thread only writing its buffer (non-temporal stores of a constant where the
// CPU has them): bytes written per second.
double measure_write_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions = 3);

// What moving bytes costs on this machine, measured with the same threads: a streaming copy
// (measure_streaming_copy_bandwidth: bytes copied per second, each byte read once and written
// once), a read-only pass and a write-only pass. A byte read costs 1 / read; a byte written costs
// the cheaper of 1 / copy - 1 / read (the copy's time less its reads) and 1 / write (a stream of
// stores alone, which a write whose source is in the caches approaches): each byte at the
// cheapest rate measured. The floor this prices is a model, not a proof: an operation that meets
// faster memory than every sample comes in under it.
struct MemoryBandwidth {
  double copy_gbs = 0;
  double read_gbs = 0;
  double write_gbs = 0;  // 0: not measured (writes priced by the copy alone)
  // False when the measurements do not make a cost (a measurement failed, or a copy came out
  // faster than reading the same bytes): no floor can be priced with them.
  bool usable() const { return copy_gbs > 0 && read_gbs > copy_gbs && write_gbs >= 0; }
  double seconds_per_read_byte() const { return 1.0 / (read_gbs * 1e9); }
  double seconds_per_written_byte() const {
    const double after_reads = 1.0 / (copy_gbs * 1e9) - 1.0 / (read_gbs * 1e9);
    return write_gbs > 0 ? std::min(after_reads, 1.0 / (write_gbs * 1e9)) : after_reads;
  }
  // The least time to read `read_bytes` and write `write_bytes` at these bandwidths.
  double floor_seconds(double read_bytes, double write_bytes) const {
    return read_bytes * seconds_per_read_byte() + write_bytes * seconds_per_written_byte();
  }
};

// How much a probe of `threads` threads maps: two buffers per thread (source and destination) of
// probe_bytes_per_thread bytes each, which is
//  - `wanted` (kProbeWantedBytes for the memcpy ceiling), but no more than an equal share of
//    kProbeBudgetBytes among the 2 x threads buffers, so that more threads share a fixed total;
//  - yet no less than kProbeMinBytes (or `wanted`, when that is smaller): a thread's buffers then
//    outgrow its core's private caches, and many threads' together the shared cache;
//  - and never more than a share of 1 / kProbeAvailableShare of `available_bytes` in all;
// rounded down to a multiple of 4096 bytes, at least 4096 (docs/performance.md).
inline constexpr std::size_t kProbeWantedBytes = std::size_t{64} << 20;
inline constexpr std::uint64_t kProbeBudgetBytes = std::uint64_t{4} << 30;
inline constexpr std::size_t kProbeMinBytes = std::size_t{1} << 20;
inline constexpr std::uint64_t kProbeAvailableShare = 4;
std::size_t probe_bytes_per_thread(std::size_t wanted, int threads, std::uint64_t available_bytes);
// The memory this process can still map for `threads` new threads: MemAvailable (/proc/meminfo;
// the free pages where it cannot be read) and, under an address-space limit (RLIMIT_AS), no more
// than the room left below it less the threads' stacks.
std::uint64_t available_memory_bytes(int threads);
// probe_bytes_per_thread(wanted, threads, available_memory_bytes(threads)).
std::size_t probe_bytes(std::size_t wanted, int threads);

// Measured once per process (single-thread and all-core copy bandwidth, probe_bytes of 64 MiB per
// thread, about a second), on first use. Every buffer's construction makes that first use, so the measurement
// never falls into a dispatch or combine (docs/semantics.md, worker counts).
struct MachineBandwidth {
  double single_thread_gbs;
  double all_cores_gbs;
  int cores;
};
const MachineBandwidth& machine_bandwidth();
bool machine_bandwidth_measured();

// Cores this process may run on (its CPU affinity), without measuring anything.
int available_cores();

}  // namespace moe_ep::core
