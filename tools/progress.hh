// Progress of a long command, for a person watching it on a terminal: the phase, the step i/n and
// the seconds since the command started, on one stderr line rewritten in place ('\r') and erased
// before the command prints its report or ends. Nothing is written unless enabled (stderr is a
// terminal and --quiet was not given), and commands call it from the holder of rank 0 only (one
// thread of one process). Never written to stdout, so never into a report or a --json file.
#pragma once

#include <string_view>

namespace moe_ep::tools::progress {

// Once, at the start of a command: shows progress from now on when `wanted` and stderr is a
// terminal; the elapsed time counts from here.
void start(bool wanted);
bool enabled();

// Replaces the line with "phase step/steps (elapsed s)" ("phase (elapsed s)" when steps is 0).
// Rewrites at most ten times a second unless the phase changes.
void show(std::string_view phase, int step = 0, int steps = 0);

// Erases the line (nothing when none is shown).
void clear();

// Erases the line when the scope ends, also when it ends by an exception (an error message then
// starts on a clean line).
class Scope {
 public:
  Scope() = default;
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  ~Scope() { clear(); }
};

}  // namespace moe_ep::tools::progress
