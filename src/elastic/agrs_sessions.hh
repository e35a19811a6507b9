// All-gather sessions (DeepEP V2's AGRS) of one rank's ElasticBuffer: the configuration, the
// session bookkeeping and the collective all_gather (docs/agrs.md).
//
// Guarantees:
//  - agrs_set_config, destroy_agrs_session and all_gather are engine operations: their arguments
//    and this rank's place in its session (byte offset, slot) travel through the agreement,
//    so a rank with bad arguments raises its own error and every other rank a PeerError naming
//    it; nothing moves unless every rank agreed.
//  - The session region is symmetric memory of its own (a(num_max_session_bytes, 32) bytes per
//    rank), never the dispatch/combine pool. all_gather writes each input into row `rank` of its
//    block on every rank (peer writes inside a peer-read section), then waits for every rank
//    (a barrier): when it returns, every row of every block of the call is in place here.
//  - Tensors handed out (gathered results, in-place inputs) keep the region mapped. A released
//    region (reconfiguration, destroy, destruction) is freed when its last tensor goes, where
//    freeing is this rank's business (ranks as threads, processes of one host); memory whose
//    release is collective (MPI windows) is freed collectively when no rank holds a tensor of
//    it, and otherwise stays mapped until the process exits (comm::retire).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/transport.hh"
#include "moe_ep/agrs.hpp"
#include "moe_ep/elastic_buffer.hpp"

namespace moe_ep::engine {
class Engine;
}

namespace moe_ep::elastic {

// All session bytes and offsets are multiples of this.
inline constexpr std::int64_t kAgrsAlignment = 32;

// One rank's session region, shared by the state and every tensor viewing it.
struct AgrsRegion {
  AgrsRegion(std::unique_ptr<comm::SymmetricMemory> m, bool free_alone) : memory(std::move(m)), free_alone(free_alone) {}
  ~AgrsRegion();
  AgrsRegion(const AgrsRegion&) = delete;
  AgrsRegion& operator=(const AgrsRegion&) = delete;

  std::unique_ptr<comm::SymmetricMemory> memory;
  // Freeing it is this rank's business (no collective, no peer reaches it through this mapping).
  bool free_alone;
  bool retire = false;  // released where it cannot be freed: kept mapped until exit
};

class AgrsState : public std::enable_shared_from_this<AgrsState> {
 public:
  explicit AgrsState(engine::Engine& engine);
  ~AgrsState();  // releases the region alone (release() comes first where it can be collective)
  AgrsState(const AgrsState&) = delete;
  AgrsState& operator=(const AgrsState&) = delete;

  // `rejection` (here and in all_gather): as DispatchArgs::rejection.
  void set_config(std::int64_t num_max_session_bytes, int num_max_all_gathers_per_session,
                  const std::string& rejection = {});
  void create_session();
  void destroy_session();
  std::vector<Tensor> inplace_tensors(std::span<const AgrsShape> shapes, DType dtype);
  AllGatherResult all_gather(std::span<const TensorView> tensors, const std::string& rejection);
  // The handle's check (any thread): `session` is the open one.
  void check_handle(std::uint64_t session) const;
  // Ends the session and releases the region: collectively (an operation) when `collective`,
  // else alone. Throws only from the collective.
  void release(bool collective, const char* operation);

  // What the operations (agrs_sessions.cc) read and change.
  engine::Engine& engine() { return engine_; }
  bool configured() const { return region_ != nullptr; }
  std::int64_t session_bytes() const { return bytes_; }  // S
  int max_slots() const { return slots_limit_; }        // Q
  std::uint64_t open_session() const { return open_.load(std::memory_order_acquire); }
  std::int64_t cursor() const { return cursor_; }
  int slots_used() const { return slots_; }
  std::byte* base() const { return region_ ? region_->memory->local() : nullptr; }
  std::byte* peer_base(int rank) const { return region_->memory->node_peer(rank); }
  // Whether a tensor of this rank still views the region.
  bool region_kept() const { return region_ != nullptr && region_.use_count() > 1; }
  void close_session() { open_.store(0, std::memory_order_release); }
  void advance(std::int64_t cursor) {
    cursor_ = cursor;
    ++slots_;
  }
  // Drops the state's reference; `kept_anywhere`: some rank still holds tensors of its region.
  void drop_region(bool kept_anywhere);
  void install_region(std::unique_ptr<comm::SymmetricMemory> memory, std::int64_t bytes, int slots);
  // A tensor over `bytes` bytes of the region from `offset` (a view: keeps the region mapped).
  Tensor view(std::int64_t offset, DType dtype, std::span<const std::int64_t> shape) const;

 private:
  engine::Engine& engine_;
  const int rank_;
  std::shared_ptr<AgrsRegion> region_;
  std::int64_t bytes_ = 0;  // S = a(num_max_session_bytes, 32)
  int slots_limit_ = 0;     // Q
  std::uint64_t sessions_ = 0;       // sessions created so far
  std::atomic<std::uint64_t> open_{0};  // the open session's number; 0: none
  std::int64_t cursor_ = 0;
  int slots_ = 0;
};

}  // namespace moe_ep::elastic
