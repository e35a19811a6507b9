// moe-ep bench --sweep KEY=LIST: the prefill path (and, under MPI, the MPI_Alltoallv baseline)
// measured at each value of one parameter, with the memcpy ceiling after each point; written as
// a table, JSON and CSV (docs/performance.md).
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hh"
#include "moe_ep/error.hpp"
#include "progress.hh"
#include "report.hh"

namespace moe_ep::tools {
namespace bench {

// The values of --sweep KEY=LIST: a comma list, where "a,b,...,z" continues a, b geometrically
// (by b / a, b a multiple of a) up to z.
std::vector<int> sweep_values(const std::string& key, const std::string& list) {
  std::vector<std::string> items;
  for (std::size_t begin = 0;;) {
    const auto comma = list.find(',', begin);
    items.push_back(list.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  auto number = [&](const std::string& item) {
    int v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || end != item.data() + item.size() || v < 1)
      throw InvalidArgument(fmt::format("--sweep {}: '{}' is not a positive integer", key, item));
    return v;
  };
  std::vector<int> values;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i] != "...") {
      values.push_back(number(items[i]));
      continue;
    }
    if (i < 2 || i + 1 != items.size() - 1)
      throw InvalidArgument(fmt::format("--sweep {}: '...' goes between two first values and the last, as in 128,256,...,8192", key));
    const int a = values[0], b = values[1], last = number(items[i + 1]);
    if (values.size() != 2 || b <= a || b % a != 0)
      throw InvalidArgument(fmt::format("--sweep {}: '...' continues a geometric series: the second value ({}) must be a "
                                        "multiple of the first ({}) and larger",
                                        key, b, a));
    for (std::int64_t v = std::int64_t{b} * (b / a); v <= last; v *= b / a) values.push_back(static_cast<int>(v));
    if (values.back() != last)
      throw InvalidArgument(fmt::format("--sweep {}: {} is not in the series {},{},... (it would end at {})", key, last,
                                        a, b, values.back()));
    break;
  }
  for (std::size_t i = 1; i < values.size(); ++i)
    if (values[i] <= values[i - 1])
      throw InvalidArgument(fmt::format("--sweep {}: values must increase ({} after {})", key, values[i], values[i - 1]));
  return values;
}

// --sweep: one shape (the prefill path: V2 dispatch, cached dispatch and combine, or V1 normal
// mode) measured at every value of one parameter, with the memcpy ceiling after each point.
// The swept parameter and its values, checked against the launch (--sweep KEY=LIST).
std::pair<std::string, std::vector<int>> sweep_parameter(const BenchOptions& options, const BenchOptions& base) {
  const auto eq = options.sweep.find('=');
  const std::string key = options.sweep.substr(0, eq);
  if (eq == std::string::npos || (key != "tokens" && key != "ranks" && key != "hidden" && key != "experts"))
    throw InvalidArgument(fmt::format("--sweep is '{}', expected tokens=LIST, ranks=LIST, hidden=LIST or experts=LIST",
                                      options.sweep));
  const std::vector<int> values = sweep_values(key, options.sweep.substr(eq + 1));
  if (key == "ranks" && options.launch.transport != "local")
    throw InvalidArgument("--sweep ranks=... runs ranks as threads of this process (--transport local): under mpirun the "
                          "job's size sets the ranks");
  for (int v : values) {
    if (key == "hidden" && v % 128 != 0)
      throw InvalidArgument(fmt::format("--sweep hidden: {} is not a multiple of 128 (FP8 dispatch with per-128 scales)", v));
    if (key == "experts" && (v % base.ranks != 0 || v < base.topk))
      throw InvalidArgument(fmt::format("--sweep experts: {} experts must be a multiple of the {} ranks and at least "
                                        "--topk ({})",
                                        v, base.ranks, base.topk));
    if (key == "ranks" && (base.experts % v != 0 || v % base.nodes != 0 || v > kMaxToolRanks))
      throw InvalidArgument(fmt::format("--sweep ranks: {} ranks must divide --experts ({}), be a multiple of the {} "
                                        "logical node(s) and be at most {}",
                                        v, base.experts, base.nodes, kMaxToolRanks));
  }
  return {key, values};
}

// One point's operations: into the JSON point, the CSV and the table.
void record_point(const std::string& key, int v, const BenchOptions& o, const ShapeResult& r, const Ceiling& ceiling,
                  nlohmann::json& point, std::string& csv, Table& table) {
  for (const auto& op : r.operations) {
    nlohmann::json one = result_json(r, op, ceiling.gbs);
    point["results"].push_back(one);
    const auto up = speedup(r, op);
    const auto floor = floor_seconds(op, r);
    csv += fmt::format("{},{},{},{},{},{},{},{:.9g},{:.17g},{:.6g},{:.6g},{:.6g},{},{:.6g},{},{}\n", key, v, o.ranks,
                       o.prefill_tokens, o.hidden, op.operation, op.baseline_of.empty() ? 0 : 1, op.seconds, op.bytes,
                       one["gbs"].get<double>(), ceiling.gbs, one["ratio"].get<double>(),
                       up ? fmt::format("{:.6g}", *up) : "", r.memory.read_gbs,
                       floor ? fmt::format("{:.9g}", *floor) : "", floor ? fmt::format("{:.6g}", *floor / op.seconds) : "");
    table.row({std::to_string(v), op.operation, fmt::format("{:.1f}", op.seconds * 1e6),
               fmt::format("{:.2f}", one["gbs"].get<double>()), fmt::format("{:.2f}", ceiling.gbs),
               fmt::format("{:.2f}", one["ratio"].get<double>()), floor ? fmt::format("{:.1f}", *floor * 1e6) : "-",
               floor ? fmt::format("{:.2f}", *floor / op.seconds) : "-",
               up ? fmt::format("{:.2f}x", *up) : op.baseline_of.empty() ? "-" : "1 (baseline)"});
  }
}

int sweep_command(const BenchOptions& options, Launch& launch) {
  progress::Scope progress_line;  // the progress line (stderr, a terminal only) ends with the command
  const bool v1 = options.api == "v1";
  const bool mpi = options.launch.transport != "local";
  BenchOptions base = options;
  base.ranks = launch.size();
  base.nodes = launch.topology().num_scaleout;
  const auto [key, values] = sweep_parameter(options, base);
  const std::string json_path = options.json_path.empty() && options.csv_path.empty() ? "sweep-" + key + ".json" : options.json_path;
  const std::string csv_path = options.json_path.empty() && options.csv_path.empty() ? "sweep-" + key + ".csv" : options.csv_path;

  nlohmann::json json = record_header(base, launch);
  json["sweep"] = {{"parameter", key}, {"values", values}};
  json["points"] = nlohmann::json::array();
  std::string csv = "parameter,value,ranks,tokens_per_rank,hidden,operation,baseline,seconds,bytes,gbs,memcpy_gbs,ratio,"
                    "speedup_vs_alltoallv,read_gbs,floor_seconds,efficiency\n";
  Table table({key, "operation", "time (us)", "GB/s", "memcpy GB/s", "ratio", "floor (us)", "efficiency",
               "speed-up vs alltoallv"});
  int threads = 0;
  for (int v : values) {
    BenchOptions o = base;
    std::unique_ptr<Launch> own;
    Launch* at = &launch;
    if (key == "tokens") o.prefill_tokens = v;
    if (key == "hidden") o.hidden = v;
    if (key == "experts") o.experts = v;
    if (key == "ranks") {
      LaunchOptions lo = options.launch;
      lo.ranks = v;
      lo.ranks_given = true;
      lo.nodes = base.nodes;
      lo.ranks_per_node = 0;
      own = make_launch(nullptr, nullptr, lo);
      at = own.get();
      o.ranks = v;
    }
    ShapeResult r = measure(*at, o, key + "=" + std::to_string(v), o.prefill_tokens, o.prefill_iterations,
                            v1 ? v1_setup(o, o.prefill_tokens) : v2_setup(o, o.prefill_tokens));
    Ceiling ceiling;
    ceiling.measure(*at, r.workers);
    measure_memory(*at, r);
    threads = ceiling.threads;
    if (!at->reports()) continue;
    nlohmann::json point = {{"value", v}, {"ranks", o.ranks}, {"tokens_per_rank", o.prefill_tokens}, {"hidden", o.hidden},
                            {"experts", o.experts}, {"workers", r.workers}, {"memcpy_threads", ceiling.threads},
                            {"memcpy_gbs", ceiling.gbs}, {"streaming_copy_gbs", r.memory.copy_gbs},
                            {"read_gbs", r.memory.read_gbs}, {"write_gbs", r.memory.write_gbs}};
    record_point(key, v, o, r, ceiling, point, csv, table);
    json["points"].push_back(point);
  }
  if (!launch.reports()) return 0;
  progress::clear();
  const std::string swept = key;  // a structured binding: clang 14 does not capture it
  auto unless_swept = [&](const char* name, int value) { return swept == name ? std::string("swept") : std::to_string(value); };
  fmt::print("moe-ep bench --sweep {} ({}): {}; hidden {}, experts {}, top-{}, tokens per rank {}; FP8 dispatch "
             "(per-128 scales), BF16 combine\n\n",
             options.sweep, v1 ? "V1 Buffer, normal mode" : "V2 ElasticBuffer", launch.describe(),
             unless_swept("hidden", base.hidden), unless_swept("experts", base.experts), base.topk,
             unless_swept("tokens", base.prefill_tokens));
  table.print();
  print_formulas(base, v1, mpi, threads, true);
  if (!json_path.empty()) write_file(json_path, json.dump(2) + "\n");
  if (!csv_path.empty()) write_file(csv_path, csv);
  fmt::print("wrote{}{}{}{}\n", json_path.empty() ? "" : " ", json_path, csv_path.empty() ? "" : " ", csv_path);
  return 0;
}

}  // namespace bench

void add_bench_record_options(CLI::App& bench, BenchOptions& o) {
  bench.add_option("--sweep", o.sweep,
                   "measure the prefill path at each value of one parameter: tokens=LIST, ranks=LIST (in-process), "
                   "hidden=LIST or experts=LIST (top-k kept); LIST is a comma list, a,b,...,z continuing a geometric series "
                   "(e.g. tokens=128,256,...,8192); writes JSON and CSV (default sweep-KEY.json and sweep-KEY.csv)");
  bench.add_option("--csv", o.csv_path, "with --sweep: write the points as CSV to this file");
}

}  // namespace moe_ep::tools
