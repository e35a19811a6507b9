// The bound of `moe-ep bench`'s rows: the least traffic of each operation (bench.hh, Traffic), the
// memory bandwidth of the ranks' threads at a shape's working set, and the floor they make.
#include <algorithm>
#include <cstdint>
#include <optional>

#include "bench.hh"
#include "core/bandwidth.hh"
#include "progress.hh"

namespace moe_ep::tools::bench {

Traffic dispatch_traffic(std::int64_t rows, std::int64_t routed_tokens, std::int64_t row_bytes) {
  return {static_cast<double>(routed_tokens) * static_cast<double>(row_bytes),
          static_cast<double>(rows) * static_cast<double>(row_bytes)};
}

// Tokens of `topk` with at least one expert.
std::int64_t routed_tokens(const Tensor& topk) {
  std::int64_t routed = 0;
  const std::int64_t k = topk.size(1);
  for (std::int64_t t = 0; t < topk.size(0); ++t) {
    bool any = false;
    for (std::int64_t j = 0; j < k; ++j) any = any || topk.data_as<const std::int64_t>()[t * k + j] >= 0;
    routed += any ? 1 : 0;
  }
  return routed;
}

Traffic combine_traffic(std::int64_t rows, std::int64_t tokens, std::int64_t row_bytes) {
  return {static_cast<double>(rows) * static_cast<double>(row_bytes),
          static_cast<double>(tokens) * static_cast<double>(row_bytes)};
}

Traffic low_latency_dispatch_traffic(std::int64_t pairs, std::int64_t tokens, std::int64_t hidden) {
  return {static_cast<double>(tokens) * 2.0 * static_cast<double>(hidden),
          static_cast<double>(pairs) * static_cast<double>(hidden + 4 * (hidden / 128))};
}

Traffic low_latency_combine_traffic(std::int64_t pairs, std::int64_t tokens, std::int64_t hidden) {
  return {static_cast<double>(pairs) * 2.0 * static_cast<double>(hidden),
          static_cast<double>(tokens) * 2.0 * static_cast<double>(hidden)};
}

std::optional<double> floor_seconds(const Measured& op, const ShapeResult& r) {
  if (!r.memory.usable() || !op.network_alone_of.empty()) return std::nullopt;  // the network's, not memory's
  return r.memory.floor_seconds(op.read_bytes, op.write_bytes);
}

std::size_t bandwidth_working_set(double traffic, int threads) {
  // A copy of B bytes moves 2B: each thread's share of the traffic, halved.
  const double share = traffic / (2.0 * std::max(threads, 1));
  return std::clamp<std::size_t>(static_cast<std::size_t>(share), std::size_t{1} << 20, std::size_t{64} << 20) / 64 * 64;
}

void sample_memory(Group& g, int workers, std::size_t bytes, ShapeResult& r) {
  if (g.rank() == 0) {
    const int on_host = std::min(g.ranks_on_host(), g.size());
    const int hosts = g.size() / on_host;
    bytes = core::probe_bytes(bytes, on_host * workers);  // what the machine holds (core/bandwidth.hh)
    r.memory_bytes_per_thread = bytes;
    r.memory.copy_gbs =
        std::max(r.memory.copy_gbs, core::measure_streaming_copy_bandwidth(on_host * workers, bytes, 1) * hosts);
    r.memory.read_gbs = std::max(r.memory.read_gbs, core::measure_read_bandwidth(on_host * workers, bytes, 1) * hosts);
    r.memory.write_gbs =
        std::max(r.memory.write_gbs, core::measure_write_bandwidth(on_host * workers, bytes, 1) * hosts);
  }
  g.barrier();
}

void measure_memory(Launch& launch, ShapeResult& r) {
  double traffic = 0;
  for (const auto& op : r.operations) traffic = std::max(traffic, op.read_bytes + op.write_bytes);
  launch.run([&](Group& g) {
    if (g.rank() == 0) progress::show(r.shape + " memory bandwidth");
    const std::size_t bytes = bandwidth_working_set(traffic, g.size() * r.workers);
    for (int i = 0; i < 5; ++i) sample_memory(g, r.workers, bytes, r);
  });
}

}  // namespace moe_ep::tools::bench
