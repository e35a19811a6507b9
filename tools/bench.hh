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
#include "core/bandwidth.hh"
#include "moe_ep/group.hpp"

namespace moe_ep::tools::bench {

// One timed operation of a shape: median over iterations of the slowest rank.
struct Measured {
  std::string operation;
  std::string baseline_of;  // for a baseline operation: the operation of ours it stands beside
  // For the network alone (across hosts): the operation of ours whose scale-out bytes it exchanges.
  std::string network_alone_of;
  double seconds = 0;
  std::vector<double> samples;  // [iteration] seconds of the slowest rank
  double bytes = 0;  // logical bytes, all ranks
  // The least bytes any implementation must read and write for this call, all ranks (Traffic).
  double read_bytes = 0, write_bytes = 0;
  std::vector<std::uint64_t> scaleout_bytes;  // [rank] bytes put to other nodes in one call
};

struct ShapeResult {
  std::string shape;
  int tokens = 0;
  int workers = 1;
  std::vector<Measured> operations;
  std::vector<std::int64_t> node_pairs, rank_pairs;  // [rank] (token, remote node / remote rank) pairs
  // One barrier round between the same ranks on the same transport (the latency floor): the
  // slowest rank's time per barrier over back-to-back barriers, median of three runs.
  double barrier_seconds = 0;
  // The memory bandwidth of the ranks' threads at this shape's working set: each thread copies
  // (streaming stores), then reads, a buffer of its share of the shape's traffic (1 to 64 MiB), so
  // that a shape whose data stays in the caches is priced at the caches' speed; sampled after every
  // timed round and five times after the shape, the best copy and read kept.
  core::MemoryBandwidth memory;
  std::size_t memory_bytes_per_thread = 0;
};

// The least bytes an operation must move: what it reads and what it writes (this rank's share).
//  - dispatch: every routed token read once at its source (a token that goes to several ranks need
//    not be read again for each), every received row written once (payload, scales, top-k ids and
//    weights);
//  - combine: every returned row read once, every combined token written once;
//  - low-latency dispatch: every token's BF16 row read once (its FP8 cast formed on the way),
//    every (token, expert) row written once (FP8 payload and scales);
//  - low-latency combine: every (token, expert) row read once, every token written once.
struct Traffic {
  double read = 0, write = 0;
};
Traffic dispatch_traffic(std::int64_t rows, std::int64_t routed_tokens, std::int64_t row_bytes);
// Tokens of `topk` (int64 [N, k]) with at least one expert.
std::int64_t routed_tokens(const Tensor& topk);
Traffic combine_traffic(std::int64_t rows, std::int64_t tokens, std::int64_t row_bytes);
Traffic low_latency_dispatch_traffic(std::int64_t pairs, std::int64_t tokens, std::int64_t hidden);
Traffic low_latency_combine_traffic(std::int64_t pairs, std::int64_t tokens, std::int64_t hidden);

// Per rank: set up, then return the operations to time and their logical bytes (after one run).
struct Operation {
  std::string name;
  std::function<void()> call;
  std::int64_t rows = 0;  // received rows on this rank
  std::int64_t row_bytes = 0;
  std::string baseline_of;
  Traffic traffic;  // this rank's share of the operation's least traffic
  std::string network_alone_of;  // as in Measured
};
// pairs: this rank's (token, remote node) and (token, remote rank) pairs (remote_pairs).
using Setup = std::function<std::vector<Operation>(Group&, int& workers, std::pair<std::int64_t, std::int64_t>& pairs)>;

// The memcpy ceiling: every rank's worker threads copying at once, the best of the calls.
struct Ceiling {
  double gbs = 0;
  int threads = 0;
  void measure(Launch& launch, int workers);
};
// Each thread's buffer for a bandwidth sample: its share of `traffic` bytes (all ranks), 1 to 64 MiB
// (sample_memory then maps no more than the machine holds: core::probe_bytes).
std::size_t bandwidth_working_set(double traffic, int threads);
// One sample of the memory bandwidth (rank 0 measures with the threads of its host's ranks, each
// with core::probe_bytes(bytes, threads), while the others wait; collective): r.memory keeps the
// best copy and read seen.
void sample_memory(Group& g, int workers, std::size_t bytes, ShapeResult& r);
// Five more samples after r's rounds, at r's working set (the largest traffic of its operations).
void measure_memory(Launch& launch, ShapeResult& r);
// The floor of `op` (seconds; nullopt when the bandwidths do not make a cost): its least traffic
// priced at r.memory.
std::optional<double> floor_seconds(const Measured& op, const ShapeResult& r);

ShapeResult measure(Launch& launch, const BenchOptions& o, const std::string& shape, int tokens, int iterations,
                    const Setup& setup);
// The bench's MoE layer at `tokens` per rank: the shape of `o`, FP8 dispatch.
LayerConfig layer(const BenchOptions& o, int tokens);
// Bytes of one received row as the bench counts them (the compact layout): dispatch is the FP8
// payload, its per-128 scales and top-k ids and weights; combine the BF16 row and top-k weights.
std::int64_t compact_dispatch_row(const BenchOptions& o);
std::int64_t compact_combine_row(const BenchOptions& o);
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
