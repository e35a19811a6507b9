// ElasticBuffer's Engram, PP and barrier methods (docs/engram-pp.md): argument translation onto
// EngramStore, PpChannels and CollectiveCall, and the release of their memory.
#include <fmt/format.h>

#include "core/failure.hh"
#include "core/log.hh"
#include "elastic/collective_call.hh"
#include "elastic/engram_store.hh"
#include "elastic/pp_channels.hh"
#include "engine/engine.hh"
#include "moe_ep/elastic_buffer.hpp"

namespace moe_ep {

namespace {

// The store or channels of a usable buffer: after destroy() they are gone, and the engine says so
// (StateError) before they are reached.
template <class Part>
Part& part_of(engine::Engine& engine, const std::unique_ptr<Part>& part, const char* operation) {
  engine.check_usable(operation);
  return *part;
}

}  // namespace

std::pair<std::int64_t, std::int64_t> ElasticBuffer::get_engram_storage_size_hint(std::int64_t num_entries,
                                                                                  std::int64_t hidden,
                                                                                  std::int64_t num_max_tokens_per_rank,
                                                                                  DType dtype) {
  return elastic::EngramStore::size_hint(num_entries, hidden, num_max_tokens_per_rank, dtype);
}

void ElasticBuffer::engram_write(const TensorView& storage, const Tensor& sf, const std::string& rejection) {
  std::lock_guard lock(calls_);
  part_of(*engine_, engram_, "engram_write").write(storage, sf, rejection);
}

EngramFetchResult ElasticBuffer::engram_fetch(const TensorView& indices, int num_qps,
                                              bool use_tma_aligned_col_major_sf) {
  std::lock_guard lock(calls_);
  return part_of(*engine_, engram_, "engram_fetch").fetch(indices, num_qps, use_tma_aligned_col_major_sf);
}

std::int64_t ElasticBuffer::get_pp_buffer_size_hint(std::int64_t num_max_tensor_bytes,
                                                    std::int64_t num_max_inflight_tensors) {
  return elastic::PpChannels::size_hint(num_max_tensor_bytes, num_max_inflight_tensors);
}

void ElasticBuffer::pp_set_config(std::int64_t num_max_tensor_bytes, std::int64_t num_max_inflight_tensors,
                                  const std::string& rejection) {
  std::lock_guard lock(calls_);
  part_of(*engine_, pp_, "pp_set_config").set_config(num_max_tensor_bytes, num_max_inflight_tensors, num_bytes(), rejection);
}

void ElasticBuffer::pp_send(const TensorView& t, int dst_rank_idx, int num_sms) {
  std::lock_guard lock(calls_);
  part_of(*engine_, pp_, "pp_send").send(t, dst_rank_idx, num_sms);
}

void ElasticBuffer::pp_recv(const TensorView& t, int src_rank_idx, int num_sms) {
  std::lock_guard lock(calls_);
  part_of(*engine_, pp_, "pp_recv").recv(t, src_rank_idx, num_sms);
}

// DeepEP's flags choose streams, CTAs and device syncs; on the host every combination is the same
// full barrier (an agreement over every rank, after this rank's queued asynchronous work).
void ElasticBuffer::barrier(bool use_comm_stream, bool with_cpu_sync, bool sequential, const std::string& rejection) {
  std::lock_guard lock(calls_);
  elastic::CollectiveCall call;
  call.rejection = rejection;
  elastic::run_collective(*engine_, "barrier", std::move(call));
}

// Peers read this rank's Engram storage and write its PP slots without it taking part: the memory
// may go only once every rank has passed a collective after its last such call (the destruction
// below, or destroy()). Where that cannot be known (the buffer is broken, or explicitly_destroy
// without destroy()), it stays mapped until the process exits, as the engine's pool does.
void ElasticBuffer::release_extras() noexcept {
  const bool holds = (engram_ && engram_->holds_memory()) || (pp_ && pp_->holds_memory());
  if (!holds) return;
  bool quiet = false;
  if (engine_ && !config_.explicitly_destroy && !core::capture([&] { engine_->check_usable("destruction"); })) {
    const std::exception_ptr error = core::capture([&] { elastic::run_collective(*engine_, "destruction", {}); });
    quiet = error == nullptr;
    if (error)
      core::warn(core::Subsys::kAlloc,
                 "ElasticBuffer #{} on rank {}: the destruction collective failed ({}); its Engram and PP memory "
                 "stays mapped", engine_->facts.id, engine_->facts.rank, comm::message_of(error));
  }
  if (!quiet) {
    if (engram_) engram_->retire();
    if (pp_) pp_->retire();
  }
  engram_.reset();
  pp_.reset();
}

}  // namespace moe_ep
