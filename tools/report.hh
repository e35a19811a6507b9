// What the reports share: a plain-text table with right-aligned columns (first column
// left-aligned), and buffer sizes in MiB.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace moe_ep::tools {

class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  void print() const {
    std::vector<std::size_t> width(rows_.front().size(), 0);
    for (const auto& r : rows_)
      for (std::size_t i = 0; i < r.size() && i < width.size(); ++i) width[i] = std::max(width[i], r[i].size());
    for (const auto& r : rows_) {
      std::string line;
      for (std::size_t i = 0; i < r.size() && i < width.size(); ++i)
        line += i == 0 ? fmt::format("{:<{}}", r[i], width[i]) : fmt::format("  {:>{}}", r[i], width[i]);
      fmt::print("{}\n", line);
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

// "64 MiB", "0.25 MiB": whole MiB without decimals, anything else with two.
inline std::string mib_text(std::size_t bytes) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  return bytes % kMiB == 0 ? fmt::format("{} MiB", bytes / kMiB) : fmt::format("{:.2f} MiB", double(bytes) / kMiB);
}

}  // namespace moe_ep::tools
