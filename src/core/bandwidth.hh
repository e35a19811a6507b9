// Memory bandwidth measurements: the memcpy ceiling that benchmarks report against, and the
// inputs of the worker-count model.
//
// measure_copy_bandwidth runs `threads` threads, each copying its own pre-faulted buffer of
// `bytes_per_thread` bytes (source and destination distinct), `repetitions` times after one
// warm-up pass, all threads starting together; it returns payload bytes copied per second
// (GB/s, 1e9) over the best repetition's wall time. Buffers larger than the last-level cache
// measure DRAM; smaller ones measure caches.
#pragma once

#include <cstddef>

namespace moe_ep::core {

double measure_copy_bandwidth(int threads, std::size_t bytes_per_thread, int repetitions = 3);

// Measured once per process (single-thread and all-core copy bandwidth, 64 MiB per thread, about
// a second), on first use. Every buffer's construction makes that first use, so the measurement
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
