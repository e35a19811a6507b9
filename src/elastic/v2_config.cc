#include "elastic/v2_config.hh"

#include "core/checks.hh"
#include "core/timeout.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::elastic {

using core::checked_timeout;
using core::fail;

void check_config(std::string_view ctx, const ElasticBufferConfig& c) {
  if (c.num_bytes < 0) fail(ctx, "num_bytes = {} is negative", c.num_bytes);
  // Engram storage (docs/engram-pp.md): part of num_bytes, which is then required.
  if (c.num_cpu_bytes < 0) fail(ctx, "num_cpu_bytes = {} is negative", c.num_cpu_bytes);
  if (c.num_cpu_bytes > 0 && c.num_bytes == 0)
    fail(ctx, "num_bytes is required with num_cpu_bytes = {} > 0 (it is the total of the pool and the Engram storage)",
         c.num_cpu_bytes);
  if (c.num_cpu_bytes % kBufferAlignment != 0)
    fail(ctx, "num_cpu_bytes = {} is not a multiple of {} (2 MiB)", c.num_cpu_bytes, kBufferAlignment);
  if (c.num_cpu_bytes > c.num_bytes && c.num_bytes > 0)
    fail(ctx, "num_cpu_bytes = {} exceeds num_bytes = {} (the total of the pool and the Engram storage)",
         c.num_cpu_bytes, c.num_bytes);
  if (c.num_bytes == 0 && c.num_max_tokens_per_rank <= 0)
    fail(ctx, "num_max_tokens_per_rank = {} must be positive when num_bytes is not given", c.num_max_tokens_per_rank);
  if (c.num_bytes == 0 && c.hidden <= 0) fail(ctx, "hidden = {} must be positive when num_bytes is not given", c.hidden);
  if (c.num_max_tokens_per_rank < 0) fail(ctx, "num_max_tokens_per_rank = {} is negative", c.num_max_tokens_per_rank);
  if (c.hidden < 0) fail(ctx, "hidden = {} is negative", c.hidden);
  if (c.hidden > kMaxHidden) fail(ctx, "hidden = {} is outside [0, {}]", c.hidden, kMaxHidden);
  if (c.num_topk < 0 || c.num_topk > kMaxTopk) fail(ctx, "num_topk = {} is outside [0, {}]", c.num_topk, kMaxTopk);
  if (c.num_bytes % kBufferAlignment != 0)
    fail(ctx, "num_bytes = {} is not a multiple of {} (2 MiB)", c.num_bytes, kBufferAlignment);
  if (c.use_fp8_dispatch && c.hidden % kRowByteMultiple != 0)
    fail(ctx, "hidden = {} must be a multiple of {} with use_fp8_dispatch (an FP8 row of hidden bytes must be a "
         "multiple of {} bytes)", c.hidden, kRowByteMultiple, kRowByteMultiple);
  checked_timeout(ctx, "num_cpu_timeout_secs", c.num_cpu_timeout_secs);
  if (c.num_allocated_qps < 0) fail(ctx, "num_allocated_qps = {} is negative", c.num_allocated_qps);
}

}  // namespace moe_ep::elastic
