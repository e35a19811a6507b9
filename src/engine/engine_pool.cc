// The symmetric pool of an engine and its growth (EngineConfig::grow_pool; docs/sizing.md).
//
// A growth runs inside an operation, after its agreement, with a need every rank computed from
// agreed values: every rank allocates the same new pool in the same collective, at the same point
// of the same operation. No rank reads the old pool any more at that point (every earlier
// operation ended with its node barrier; a normal-mode call voids pending low-latency results
// before it starts), so it is replaced at once. Views of the old pool (memory_owner) keep it
// mapped for as long as they live.
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "core/arith.hh"
#include "core/log.hh"
#include "engine/engine.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::engine {

std::shared_ptr<comm::SymmetricMemory> Engine::memory_owner() const {
  std::lock_guard lock(state_mutex_);
  return memory_;
}

void Engine::grow_pool(std::int64_t need, const std::string& context) {
  const std::int64_t old_bytes = pool_bytes();
  if (need <= old_bytes) return;
  // At least doubling: a workload whose calls grow a little at a time replaces the pool a few
  // times, not once per call.
  const std::int64_t bytes = core::round_up<std::int64_t>(std::max(need, 2 * old_bytes), kBufferAlignment);
  std::shared_ptr<comm::SymmetricMemory> grown = transport_->allocate_symmetric(
      static_cast<std::size_t>(bytes), facts.wait("pool growth: allocation"), bytes <= kPrefaultLimit);
  std::shared_ptr<comm::SymmetricMemory> old;
  {
    std::lock_guard lock(state_mutex_);
    old = std::exchange(memory_, std::move(grown));
    pool_bytes_.store(bytes, std::memory_order_release);
  }
  core::info(core::Subsys::kAlloc, "{}: the symmetric pool of {} #{} grew from {} to {} bytes per rank ({} needed)",
             context, facts.config.name, facts.id, old_bytes, bytes, need);
  // Ranks in one address space release the old pool when its last view goes. Elsewhere a
  // release can be collective (an MPI window), which a view living on one rank would put out of
  // step: the old pool is retired (comm::retire: released now where peers map it themselves,
  // host memfds; kept until exit otherwise).
  if (!transport_->ranks_share_address_space()) comm::retire(std::move(old));
}

}  // namespace moe_ep::engine
