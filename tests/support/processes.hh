// Scenarios on forked processes, for the host transport's tests: run_processes forks N children,
// serves the all-gather they bootstrap through (pipes to and from this process), and returns how
// each ended, with the failures and output it wrote to its result pipe. Children never return
// into gtest: they _exit (and are killed by alarm after 60 s, so a hang fails instead of stalling
// the suite). Failures and expect_throw collect what a child checks as text.
#pragma once

#include <sys/wait.h>

#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "moe_ep/error.hpp"
#include "moe_ep/host.hpp"

namespace moe_ep::testing {

// A child's scenario: returns its failures (empty: success); may write what the parent needs to
// `output`.
using Body = std::function<std::string(int rank, int size, const host::AllGather& all_gather, std::string* output)>;
// Rewrites the blocks of a gather before they go back (to fake what make_group must refuse).
using Rewrite = std::function<void(std::vector<std::string>&)>;

struct Child {
  int status = 0;  // waitpid
  std::string failures;
  std::string output;
  bool exited_ok() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// One line per child: its exit status or signal and its failures.
std::string describe(const std::vector<Child>& children);

// Forks `size` children running `body`; serves their all-gathers (rounds until a child stops
// taking part) and returns how each ended. A child that calls all_gather more than once fails.
std::vector<Child> run_processes(int size, const Body& body, const Rewrite& rewrite = {});

// What a child found wrong (the first 8 problems, joined by "; ").
class Failures {
 public:
  void check(bool ok, const std::string& what) {
    if (!ok && count_++ < 8) text_ += (text_.empty() ? "" : "; ") + what;
  }
  std::string str() const { return text_; }

 private:
  std::string text_;
  int count_ = 0;
};

inline std::string ranks_text(const std::vector<int>& ranks) {
  std::string text = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) text += ',';
    text += std::to_string(ranks[i]);
  }
  return text + "]";
}

// Runs `fn`, expects it to throw E with ranks() == `ranks` (when given) and a message containing
// `needle`.
template <class E, class Fn>
void expect_throw(Failures& f, const std::string& what, Fn fn, const std::vector<int>* ranks = nullptr,
                  const std::string& needle = "") {
  try {
    fn();
    f.check(false, what + ": did not throw");
  } catch (const E& e) {
    if constexpr (std::is_base_of_v<PeerError, E>) {
      if (ranks) f.check(e.ranks() == *ranks, what + ": names ranks " + ranks_text(e.ranks()) + ", expected " + ranks_text(*ranks));
    }
    f.check(std::string(e.what()).find(needle) != std::string::npos, what + ": message lacks '" + needle + "': " + e.what());
  } catch (const std::exception& e) {
    f.check(false, what + ": threw another error: " + e.what());
  }
}

}  // namespace moe_ep::testing
