#include "comm/gather_protocol.hh"

#include "comm/wait.hh"

namespace moe_ep::comm {

Gathered EpochGather::all_gather(std::span<const std::byte> mine, Scope scope, const Wait& wait) {
  const ScopeMembers members = transport_.members(scope);
  const std::uint64_t epoch = ++epochs_[members.index];
  const int parity = static_cast<int>(epoch & 1);
  slots_.publish(members, parity, mine);
  slots_.announce(members, epoch);
  Gathered blocks = transport_.leave_on_failure([&] {
    wait_for_arrivals(
        transport_, members.count, [&](int m) { return members.rank(m); },
        [&](int m) { return slots_.announced(members, members.rank(m)) >= epoch; },
        [&](int r, unsigned poll) { return slots_.left(r, poll); }, wait);
    check_not_void(transport_, wait, members, epoch,
                   [&](int r, std::uint64_t e) { return slots_.abandoned_before(members, r, e); });
    return slots_.read_blocks(members, parity, mine);
  });
  slots_.complete(members, epoch);
  return blocks;
}

}  // namespace moe_ep::comm
