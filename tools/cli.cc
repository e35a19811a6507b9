#include "cli.hh"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string_view>

namespace moe_ep::tools {

namespace detail {

CLI::Validator integer_validator(__int128 lo, __int128 hi, const std::string& lo_text, const std::string& hi_text,
                                 bool unbounded_above) {
  const std::string range = unbounded_above ? fmt::format("(must be at least {})", lo_text)
                                            : fmt::format("{} to {}", lo_text, hi_text);
  auto check = [=](std::string& text) -> std::string {
    std::string_view s = text;
    bool negative = false;
    if (!s.empty() && (s.front() == '-' || s.front() == '+')) {
      negative = s.front() == '-';
      s.remove_prefix(1);
    }
    std::uint64_t magnitude = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), magnitude);
    if (s.empty() || end != s.data() + s.size() || ec == std::errc::invalid_argument)
      return fmt::format("'{}' is not an integer", text);
    // Beyond 64 bits: further out than any bound.
    const __int128 huge = static_cast<__int128>(1) << 70;
    __int128 value = ec == std::errc::result_out_of_range ? huge : static_cast<__int128>(magnitude);
    if (negative) value = -value;
    if (value < lo || value > hi) {
      if (value < lo && unbounded_above) return fmt::format("{} is out of range {}", text, range);
      return fmt::format("{} is out of range {} to {}", text, lo_text, hi_text);
    }
    return {};
  };
  return CLI::Validator(check, unbounded_above ? fmt::format(">={}", lo_text) : fmt::format("{}..{}", lo_text, hi_text));
}

}  // namespace detail

CLI::Validator number_from(double lo, bool strictly_above) {
  auto check = [=](std::string& text) -> std::string {
    double value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || end != text.data() + text.size() || ec != std::errc() || !std::isfinite(value))
      return fmt::format("'{}' is not a number", text);
    if (strictly_above ? !(value > lo) : !(value >= lo))
      return fmt::format("{} is out of range (must be {} {})", text, strictly_above ? "greater than" : "at least", lo);
    return {};
  };
  return CLI::Validator(check, fmt::format("{}{}", strictly_above ? ">" : ">=", lo));
}

CLI::Validator one_of(std::initializer_list<const char*> words) {
  std::vector<std::string> list(words.begin(), words.end());
  std::string joined;
  for (const auto& w : list) joined += (joined.empty() ? "" : ", ") + w;
  auto check = [list, joined](std::string& text) -> std::string {
    if (std::find(list.begin(), list.end(), text) != list.end()) return {};
    const std::string near = nearest(text, list);
    return fmt::format("'{}' is not one of {}{}", text, joined, near.empty() ? "" : fmt::format("; did you mean '{}'?", near));
  };
  std::string desc = "{";
  for (const auto& w : list) desc += (desc.size() > 1 ? "," : "") + w;
  return CLI::Validator(check, desc + "}");
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  // Option names are compared without their dashes.
  auto bare = [](const std::string& s) { return s.substr(std::min(s.find_first_not_of('-'), s.size())); };
  const std::string w = bare(word);
  std::string best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const auto& c : candidates) {
    const std::size_t d = edit_distance(w, bare(c));
    if (d < best_distance) best_distance = d, best = c;
  }
  // Close: at most 2 edits, and fewer than half the letters.
  if (best.empty() || best_distance > 2 || 2 * best_distance >= std::max(w.size(), bare(best).size())) return {};
  return best;
}

namespace {

std::vector<std::string> subcommand_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  return names;
}

std::string joined_commands(const CLI::App& app) {
  const auto names = subcommand_names(app);
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return out;
}

std::vector<std::string> option_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::Option* opt : app.get_options()) {
    for (const auto& l : opt->get_lnames()) names.push_back("--" + l);
    for (const auto& s : opt->get_snames()) names.push_back("-" + s);
  }
  return names;
}

bool has_option(const CLI::App& app, const std::string& name) {
  const auto names = option_names(app);
  return std::find(names.begin(), names.end(), name) != names.end();
}

// The command as typed: "moe-ep run".
std::string command_path(const CLI::App& app) {
  std::string path = app.get_name();
  for (const CLI::App* p = app.get_parent(); p != nullptr; p = p->get_parent()) path = p->get_name() + " " + path;
  return path;
}

std::string lowercase_first(std::string s) {
  if (!s.empty() && s[0] >= 'A' && s[0] <= 'Z' && !(s.size() > 1 && s[1] >= 'A' && s[1] <= 'Z')) s[0] = static_cast<char>(s[0] - 'A' + 'a');
  return s;
}

}  // namespace

std::string check_command_word(const CLI::App& app, int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (!word.empty() && word[0] == '-') {  // the top level's options take no values
      const std::string name = word.substr(0, word.find('='));
      if (has_option(app, name)) continue;
      const std::string near = nearest(name, option_names(app));
      return fmt::format("unknown option '{}' for '{}'{}", name, app.get_name(),
                         near.empty() ? fmt::format(": give a command first ({})", joined_commands(app))
                                      : fmt::format("; did you mean '{}'?", near));
    }
    const auto names = subcommand_names(app);
    if (std::find(names.begin(), names.end(), word) != names.end()) return {};
    const std::string near = nearest(word, names);
    return near.empty() ? fmt::format("unknown command '{}': the commands are {}", word, joined_commands(app))
                        : fmt::format("unknown command '{}'; did you mean '{}'?", word, near);
  }
  return {};
}

std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e) {
  const std::string what = e.what();
  if (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr && what.rfind("A subcommand", 0) == 0)
    return fmt::format("a command is required: {} (see moe-ep --help)", joined_commands(app));
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr) {
    const std::size_t colon = what.find(": ");
    if (colon != std::string::npos && what.find("required", colon) != std::string::npos && what.find("missing") != std::string::npos)
      return fmt::format("{} needs a value", what.substr(0, colon));
  }
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    // The innermost command given, and the first word it did not take.
    const CLI::App* command = &app;
    for (;;) {
      const auto parsed = command->get_subcommands();
      if (parsed.empty()) break;
      command = parsed.front();
    }
    std::vector<std::string> extras = app.remaining(true);
    if (!extras.empty()) {
      const std::string& word = extras.front();
      const std::string where = command_path(*command);
      if (word.size() > 1 && word[0] == '-' && !(word[1] >= '0' && word[1] <= '9')) {
        const std::string name = word.substr(0, word.find('='));
        std::string hint;
        const std::string near = nearest(name, option_names(*command));
        if (!near.empty()) {
          hint = fmt::format("; did you mean '{}'?", near);
        } else {
          for (const CLI::App* other : app.get_subcommands([](const CLI::App*) { return true; }))
            if (other != command && has_option(*other, name)) {
              hint = fmt::format(" (it is an option of '{}')", command_path(*other));
              break;
            }
        }
        return fmt::format("unknown option '{}' for '{}'{}", name, where, hint);
      }
      return fmt::format("unexpected argument '{}' for '{}'", word, where);
    }
  }
  return lowercase_first(what);
}

}  // namespace moe_ep::tools
