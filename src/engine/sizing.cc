#include "engine/sizing.hh"

#include <algorithm>

#include "core/arith.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::engine {

RegionSizes region_sizes(const Paths& paths, int num_max_tokens_per_rank, int hidden, std::int64_t payload_bytes,
                         std::int64_t scale_bytes, int k, bool allow_multiple_reduction) {
  const std::int64_t T = num_max_tokens_per_rank;
  const std::int64_t D = DispatchRecord(payload_bytes, scale_bytes, k).bytes;
  const std::int64_t Cb = CombineRecord(hidden, k).bytes;
  RegionSizes s;
  if (paths.hybrid()) {
    s.dispatch_bytes = paths.routing_nodes * T * D;
    s.combine_bytes = (allow_multiple_reduction ? paths.routing_nodes : k) * T * Cb;
  } else if (paths.direct_remote()) {
    s.dispatch_bytes = paths.num_ranks * T * D;
    s.combine_bytes = k * T * Cb;
  }
  return s;
}

std::int64_t buffer_size_hint(const Paths& paths, int num_max_tokens_per_rank, int hidden, int num_topk,
                              bool use_fp8_dispatch, bool allow_multiple_reduction) {
  const int k = num_topk == 0 ? kMaxTopk : num_topk;
  const std::int64_t payload = std::int64_t{hidden} * (use_fp8_dispatch ? 1 : 2);
  const std::int64_t scales = use_fp8_dispatch ? 4 * core::ceil_div(std::int64_t{hidden}, 32) : 0;
  const RegionSizes s = region_sizes(paths, num_max_tokens_per_rank, hidden, payload, scales, k, allow_multiple_reduction);
  return core::round_up(std::max<std::int64_t>(s.total(), 1), kBufferAlignment);
}

}  // namespace moe_ep::engine
