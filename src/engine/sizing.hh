// Buffer sizing and the layout of scale-out records (docs/sizing.md).
//
// Scale-up traffic needs no buffer space: receivers copy straight from the senders' tensors into
// their outputs. Only tokens that cross nodes travel as records through symmetric memory:
//   dispatch record  D  = a(H*es, 32) + a(4P, 32) + a(8k + 4, 32)   payload | scales | ids, weights, token
//   combine record   Cb = a(2H, 32) + a(4k, 32)                     payload | weights
// Regions (T = num_max_tokens_per_rank):
//   hybrid (logical scale-out > 1): dispatch SO*T*D, combine (multi ? SO : k)*T*Cb
//   direct across physical nodes:   dispatch R*T*D,  combine k*T*Cb
//   one physical node:              none
// Buffer = a(max(dispatch, combine, 1), 2 MiB). For sizing, FP8 assumes the worst-case scales
// (one FP32 per 32 elements, P = ceil(H/32)) and num_topk = 0 assumes k = 32.
#pragma once

#include <cstdint>

#include "core/arith.hh"
#include "moe_ep/limits.hpp"  // kBufferAlignment, kMaxTopk, kMaxHidden, kRowByteMultiple

namespace moe_ep::engine {

struct DispatchRecord {
  std::int64_t payload_bytes, scales_offset, scales_bytes, ids_offset, weights_offset, token_offset, bytes;
  DispatchRecord(std::int64_t payload, std::int64_t scale_bytes, int k)
      : payload_bytes(payload),
        scales_offset(core::round_up<std::int64_t>(payload, 32)),
        scales_bytes(scale_bytes),
        ids_offset(scales_offset + core::round_up<std::int64_t>(scale_bytes, 32)),
        weights_offset(ids_offset + 4 * k),
        token_offset(weights_offset + 4 * k),
        bytes(ids_offset + core::round_up<std::int64_t>(8 * k + 4, 32)) {}
};

struct CombineRecord {
  std::int64_t weights_offset, bytes;
  CombineRecord(int hidden, int k)
      : weights_offset(core::round_up<std::int64_t>(2 * std::int64_t{hidden}, 32)),
        bytes(weights_offset + core::round_up<std::int64_t>(4 * k, 32)) {}
};

// How tokens move between the ranks of a buffer.
struct Paths {
  int num_ranks = 1;
  int physical_nodes = 1;  // physical scale-out
  int routing_nodes = 1;   // logical scale-out: > 1 means the hybrid two-hop path
  bool hybrid() const { return routing_nodes > 1; }
  bool direct_remote() const { return !hybrid() && physical_nodes > 1; }
};

struct RegionSizes {
  std::int64_t dispatch_bytes = 0;
  std::int64_t combine_bytes = 0;
  std::int64_t total() const { return dispatch_bytes > combine_bytes ? dispatch_bytes : combine_bytes; }
};

// Exact needs of one call. payload_bytes = H * element size, scale_bytes = P * 4.
RegionSizes region_sizes(const Paths& paths, int num_max_tokens_per_rank, int hidden, std::int64_t payload_bytes,
                         std::int64_t scale_bytes, int k, bool allow_multiple_reduction);

// The constructor's formula (2 MiB aligned), see the header comment.
std::int64_t buffer_size_hint(const Paths& paths, int num_max_tokens_per_rank, int hidden, int num_topk,
                              bool use_fp8_dispatch, bool allow_multiple_reduction);

}  // namespace moe_ep::engine
