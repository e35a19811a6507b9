// The limits a caller can reach, in one place: every check of the library, the CUDA provider,
// the Python module and the moe-ep tool compares against these constants, and no other file
// restates them (docs/semantics.md, docs/dispatcher.md and docs/cuda.md quote them).
//
// Plain constexpr integers with no other dependency, so device code (nvcc) and host code
// include the same header. A value beyond a limit is refused with InvalidArgument naming the
// argument, the value and the limit, before any data moves.
#pragma once

#include <cstdint>

namespace moe_ep {

// Experts per token (num_topk, the columns of topk_idx): 1 to 32 for every call of every path;
// ElasticBuffer's num_topk = 0 sizes the buffer for 32. Fixed-size per-token lane arrays
// (routing, combine) hold this many entries.
inline constexpr int kMaxTopk = 32;

// Worker threads of one rank for one call: the limit of num_sms (ElasticBuffer dispatch and
// combine, V1 Config), of MOE_EP_NUM_WORKERS and of DispatcherOptions::num_workers.
inline constexpr int kMaxWorkers = 1024;

// Experts of a V1 low-latency call in shrink mode (Buffer with enable_shrink): every rank's
// per-expert counts travel in the blocks of the exchange that survives failed ranks, whose
// mailboxes are sized for this many (docs/legacy.md §4).
inline constexpr int kMaxShrinkExperts = 16384;

// Elements per row (hidden) of any dispatch or combine, of ElasticBuffer and of the dispatcher;
// also the byte limit of one V1 packed (NVFP4) row.
inline constexpr int kMaxHidden = 1 << 24;

// A dispatched row (hidden x element size bytes) must be a multiple of this many bytes, for every
// payload dtype (DeepEP's host check; docs/semantics.md, "Payload dtypes").
inline constexpr std::int64_t kRowByteMultiple = 16;

// A buffer's num_bytes, when given, is a multiple of this (2 MiB); sized buffers are rounded up to it.
inline constexpr std::int64_t kBufferAlignment = std::int64_t{2} << 20;

// ElasticBuffer::agrs_set_config's num_max_all_gathers_per_session: 1 to 32 all_gather calls per
// session (DeepEP's slot flags, docs/agrs.md).
inline constexpr int kMaxAgrsAllGathersPerSession = 32;

// Dimensions of a tensor: 0-d (scalars) to 6-d (the NVFP4 scale layout). TensorView::kMaxDims.
inline constexpr int kMaxTensorDims = 6;

// DispatcherOptions::num_experts and DispatcherOptions::expert_alignment: 1 to 2^20 each.
inline constexpr int kMaxDispatcherExperts = 1 << 20;
inline constexpr int kMaxDispatcherExpertAlignment = 1 << 20;

// The CUDA provider (docs/cuda.md): ranks of one host it serves, and tokens per rank
// (num_max_tokens_per_rank; the token field of its device error word holds 22 bits).
inline constexpr int kMaxCudaRanks = 64;
inline constexpr int kMaxCudaTokensPerRank = 1 << 22;

}  // namespace moe_ep
