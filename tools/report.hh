// A plain-text table with right-aligned columns (first column left-aligned).
#pragma once

#include <fmt/format.h>

#include <algorithm>
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

}  // namespace moe_ep::tools
