// All-gather sessions (DeepEP V2's AGRS) of an ElasticBuffer: the results of ElasticBuffer::all_gather
// and the handle that goes with them (docs/agrs.md).
//
// all_gather places every rank's input in this rank's session region, which is memory of its own
// beside the dispatch/combine memory: the gathered tensors are views of it, valid until the session
// ends (the next session reuses the same bytes). Views keep the region mapped, so a tensor kept
// past the end of its session, or of the buffer, reads stale bytes but never freed memory.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe_ep/tensor.hpp"

namespace moe_ep {

namespace elastic {
class AgrsState;  // internal (src/elastic/agrs_sessions.hh)
}

// One shape of agrs_get_inplace_tensor and get_agrs_num_max_session_bytes (sizes >= 0).
using AgrsShape = std::vector<std::int64_t>;

// What DeepEP's handle() does on the GPU (order the current stream after the data arrived) is
// done by the time all_gather returns; the handle keeps DeepEP's rule that it is called inside the
// session of its all_gather: otherwise StateError naming both sessions (or the destroyed buffer).
class AgrsHandle {
 public:
  AgrsHandle() = default;
  AgrsHandle(std::weak_ptr<const elastic::AgrsState> state, std::uint64_t session, int rank)
      : state_(std::move(state)), session_(session), rank_(rank) {}
  void operator()() const;
  std::uint64_t session() const { return session_; }  // the session of the all_gather (1, 2, ...)

 private:
  std::weak_ptr<const elastic::AgrsState> state_;
  std::uint64_t session_ = 0;
  int rank_ = -1;
};

struct AllGatherResult {
  // Per input, in input order: [R, *input shape] with the input's dtype; row j is rank j's input.
  std::vector<Tensor> gathered;
  AgrsHandle handle;
};

}  // namespace moe_ep
