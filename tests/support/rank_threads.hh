// Several threads of one rank sharing that rank's buffer (docs/semantics.md, "Concurrent calls"):
// the calls of one buffer are serialised, so threads may call it at once; the ranks still pair
// their calls in the order each rank's threads got the buffer.
//
// run_rank_threads starts `threads` threads on the calling rank thread, each running `rounds`
// rounds of `body`, and joins them. With take_turns, a per-rank turnstile orders the rounds:
// thread t makes its rounds at turns t, t + threads, t + 2 threads, ..., so every rank issues the
// same sequence of calls whichever thread makes them. Without it the threads run freely. A round
// that throws is a problem ("thread t round r: <type>: <message>"); a turn always passes on, so a
// failed round never stalls the others. Returns every thread's problems, thread by thread.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "support/errors.hh"

namespace moe_ep::testing {

std::vector<std::string> run_rank_threads(int threads, int rounds, bool take_turns,
                                          const std::function<void(int thread, int round, std::vector<std::string>& problems)>& body);

// Whether a refused call of free-running threads is the documented outcome of ranks that paired
// different calls: a PeerError saying that the ranks disagree.
bool ranks_disagreed(const Caught& caught);

}  // namespace moe_ep::testing
