// Internal calls of ElasticBuffer's collective Engram, PP and barrier methods for the Python
// bindings: the public ones plus `rejection` (as DispatchArgs::rejection), so that a rank whose
// arguments could not be converted still takes part in the call and every other rank raises
// PeerError naming it.
#pragma once

#include <cstdint>
#include <string>

#include "moe_ep/elastic_buffer.hpp"

namespace moe_ep::elastic {

class ExtrasAccess {
 public:
  static void engram_write(ElasticBuffer& buffer, const TensorView& storage, const Tensor& sf,
                           const std::string& rejection);
  static void pp_set_config(ElasticBuffer& buffer, std::int64_t num_max_tensor_bytes,
                            std::int64_t num_max_inflight_tensors, const std::string& rejection);
  static void barrier(ElasticBuffer& buffer, const std::string& rejection);
};

}  // namespace moe_ep::elastic
