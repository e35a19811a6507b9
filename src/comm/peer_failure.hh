// Peer failures: how every transport says that a wait or a collective was ended by other ranks.
//
// A rank that no longer takes part has a Departure (why, and the ranks its own failure named).
// The errors built here name the root cause: the culprits the departed ranks' failures named
// (other than this rank), or the departed ranks themselves when they failed on their own account;
// a wait nobody departed from ends in TimeoutError naming every rank that did not arrive. The
// in-process, host and MPI transports and the engine raise and read their failures only through
// these functions, so the messages and the ranks they name are the same on every transport.
#pragma once

#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moe_ep::comm {

struct Wait;

// Why a rank is no longer taking part: it left the group (returned or threw out of its rank
// function, its process is gone) or abandoned the channel. `culprits` are the ranks its own
// failure named (the root cause, as far as it knew); empty when it failed on its own account.
struct Departure {
  std::string reason;
  std::vector<int> culprits;
};

// The departure of a rank that abandoned the channel for `reason`, naming `culprits`.
Departure gave_up(const std::string& reason, std::vector<int> culprits);

// The ranks an error names (PeerError::ranks()), for abandon(); empty for other errors.
std::vector<int> culprits_of(const std::exception_ptr& error);
// The error's what(), or a fixed text for an exception that is not a std::exception.
std::string message_of(const std::exception_ptr& error);

// The ranks first .. first + count - 1 other than `rank` that departure_of(r) (an
// std::optional<Departure>) says departed, with their departures, in rank order.
template <class DepartureOf>
std::vector<std::pair<int, Departure>> departed_among(int first, int count, int rank, DepartureOf departure_of) {
  std::vector<std::pair<int, Departure>> departed;
  for (int r = first; r < first + count; ++r)
    if (r != rank)
      if (auto why = departure_of(r)) departed.emplace_back(r, std::move(*why));
  return departed;
}

// The error of a wait for `missing` (not empty) that did not complete: PeerError if some of them
// departed (`departure(r)`, nullopt while r is still there), naming the root cause, else
// TimeoutError naming them all.
[[noreturn]] void fail_wait(int rank, const Wait& wait, const std::vector<int>& missing, double elapsed_secs,
                            const std::function<std::optional<Departure>(int)>& departure);

// The PeerError of a wait for `missing` ended because other members gave up on the channel
// (`departed`, none of them among `missing`): once one member left a channel, none of its
// collectives can complete, so every wait on it ends at once, naming the root cause.
[[noreturn]] void fail_channel_left(int rank, const Wait& wait, const std::vector<int>& missing,
                                    const std::vector<std::pair<int, Departure>>& departed);

// The TimeoutError of a wait for `missing` that expired while those ranks themselves waited for
// others (`waits_for`: r -> the ranks r said it waits for; ranks not in it are not waiting). It
// names the ends of those chains (the ranks that wait for nobody but this rank), not the ranks in
// the middle, which are alive and stuck behind them; chains that only go round name their ranks;
// without chains it is fail_wait's TimeoutError.
[[noreturn]] void fail_wait_chain(int rank, const Wait& wait, const std::vector<int>& missing, double elapsed_secs,
                                  const std::function<const std::vector<int>*(int)>& waits_for);

// The PeerError of a collective void because some of its members gave up on it (`departed`, with
// their departures), or of a peer-read section opened after node peers left.
[[noreturn]] void fail_abandoned(int rank, const Wait& wait, const std::vector<std::pair<int, Departure>>& departed);

// The PeerError of a wait written outside the transport (Transport::check_peer) on `peer`, which
// departed (`why`).
[[noreturn]] void fail_departed(int rank, const char* phase, int peer, Departure why);

}  // namespace moe_ep::comm
