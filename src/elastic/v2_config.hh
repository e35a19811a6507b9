// The V2 contract's configuration part (core/v2_contract.hh has the calls'): the rules on
// ElasticBufferConfig and the fields every rank's buffer must share, written once for the
// built-in provider (elastic_buffer.cc) and the CUDA provider (src/cuda). Failures throw
// InvalidArgument naming the context, the field, its value and the limit.
#pragma once

#include <string_view>

#include "moe_ep/elastic_buffer.hpp"

namespace moe_ep::elastic {

// num_bytes and num_cpu_bytes, the shape (tokens, hidden, top-k), the timeout and qps.
void check_config(std::string_view context, const ElasticBufferConfig& c);

// The configuration fields every rank's buffer must share (a comm::Agreement).
template <class Agreement>
Agreement& agree_config(Agreement& a, const ElasticBufferConfig& c) {
  return a.field("num_bytes", c.num_bytes)
      .field("num_cpu_bytes", c.num_cpu_bytes)
      .field("num_max_tokens_per_rank", c.num_max_tokens_per_rank)
      .field("hidden", c.hidden)
      .field("num_topk", c.num_topk)
      .field("use_fp8_dispatch", c.use_fp8_dispatch)
      .field("allow_hybrid_mode", c.allow_hybrid_mode)
      .field("allow_multiple_reduction", c.allow_multiple_reduction);
}

}  // namespace moe_ep::elastic
