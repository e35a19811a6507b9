// The parts of `moe-ep bench` that its single run and its sweep share: the results of a timed
// shape, the per-rank setups of each API's operations, the timing loop (median over iterations of
// the slowest rank), the memcpy ceiling of the same threads and the JSON record. Internal to the
// tool.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "commands.hh"
#include "launch.hh"
#include "moe_ep/group.hpp"

namespace moe_ep::tools::bench {

// One timed operation of a shape: median over iterations of the slowest rank.
struct Measured {
  std::string operation;
  std::string baseline_of;  // for a baseline operation: the operation of ours it stands beside
  double seconds = 0;
  std::vector<double> samples;  // [iteration] seconds of the slowest rank
  double bytes = 0;  // logical bytes, all ranks
  std::vector<std::uint64_t> scaleout_bytes;  // [rank] bytes put to other nodes in one call
};

struct ShapeResult {
  std::string shape;
  int tokens = 0;
  int workers = 1;
  std::vector<Measured> operations;
  std::vector<std::int64_t> node_pairs, rank_pairs;  // [rank] (token, remote node / remote rank) pairs
};

// Per rank: set up, then return the operations to time and their logical bytes (after one run).
struct Operation {
  std::string name;
  std::function<void()> call;
  std::int64_t rows = 0;  // received rows on this rank
  std::int64_t row_bytes = 0;
  std::string baseline_of;
};
// pairs: this rank's (token, remote node) and (token, remote rank) pairs (remote_pairs).
using Setup = std::function<std::vector<Operation>(Group&, int& workers, std::pair<std::int64_t, std::int64_t>& pairs)>;

// The memcpy ceiling: every rank's worker threads copying at once, the best of the calls.
struct Ceiling {
  double gbs = 0;
  int threads = 0;
  void measure(Launch& launch, int workers);
};

ShapeResult measure(Launch& launch, const BenchOptions& o, const std::string& shape, int tokens, int iterations,
                    const Setup& setup);
// The bench's MoE layer at `tokens` per rank: the shape of `o`, FP8 dispatch.
LayerConfig layer(const BenchOptions& o, int tokens);
Setup v2_setup(const BenchOptions& o, int tokens);
Setup v1_setup(const BenchOptions& o, int tokens);
Setup low_latency_setup(const BenchOptions& o, int tokens);
std::optional<double> speedup(const ShapeResult& r, const Measured& op);
nlohmann::json result_json(const ShapeResult& r, const Measured& op, double ceiling);
nlohmann::json record_header(const BenchOptions& o, const Launch& launch);
void write_file(const std::string& path, const std::string& text);
void print_formulas(const BenchOptions& o, bool v1, bool mpi, int threads, bool sweep);
int sweep_command(const BenchOptions& options, Launch& launch);
int dispatcher_bench_command(const BenchOptions& options, Launch& launch);

}  // namespace moe_ep::tools::bench
