// The rules of moe-ep's command line that CLI11 does not state itself. Numeric options are checked
// before conversion, with messages that name the value and the accepted range ("'abc' is not an
// integer", "0 is out of range (must be at least 1)", "2000 is out of range 1 to 1024"; CLI11
// prefixes the option's name). A UsageError is a command line that cannot run: main prints
// "moe-ep: <message>" as the only line on stderr and exits 2, as it does for every parse error.
// Misspelt commands and options get the nearest known name (edit distance) as a suggestion.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace moe_ep::tools {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The exit status of every usage error.
inline constexpr int kUsageExit = 2;

namespace detail {
CLI::Validator integer_validator(__int128 lo, __int128 hi, const std::string& lo_text, const std::string& hi_text,
                                 bool unbounded_above);
}  // namespace detail

// A decimal integer in [lo, hi] (hi = the type's largest value: "at least lo").
template <class T>
CLI::Validator integer_in(T lo, T hi = std::numeric_limits<T>::max()) {
  return detail::integer_validator(static_cast<__int128>(lo), static_cast<__int128>(hi), std::to_string(lo),
                                   std::to_string(hi), hi == std::numeric_limits<T>::max());
}

// A finite number >= lo (or > lo when strictly_above).
CLI::Validator number_from(double lo, bool strictly_above);

// One of the given words: "'v3' is not one of v1, v2".
CLI::Validator one_of(std::initializer_list<const char*> words);

// Levenshtein distance, and the candidate nearest to `word` when it is close enough to be a
// likely misspelling (empty when none is).
std::size_t edit_distance(const std::string& a, const std::string& b);
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

// Before parsing: the first word that is not an option must name a subcommand of `app`;
// otherwise the message "unknown command 'runn'; did you mean 'run'?". Empty when it does.
std::string check_command_word(const CLI::App& app, int argc, const char* const* argv);

// One line for a CLI11 parse error (help and version excluded), in moe-ep's words.
std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e);

}  // namespace moe_ep::tools
