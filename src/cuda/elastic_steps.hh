// The device steps of the CUDA provider's dispatch and combine: each is a group of index-parallel
// lambdas queued on an executor (CudaExec: kernels on the rank's stream; HostExec: host threads,
// step after step). They see only the values and device pointers they are given (no host state),
// read peers' memory only after the barrier that published it, and do nothing once this rank's
// error word is set, so a failure moves no rows.
//
// Ordering (docs/semantics.md): rows are received by source rank, then source token; expert
// blocks hold their rows in that order; combine sums biases, then units in ascending key order,
// in FP32 with one BF16 rounding per level.
#pragma once

#include <cstdint>

#include "core/arith.hh"
#include "cuda/device_common.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::cuda {

// The base address of every rank's symmetric region, as this rank reaches it.
struct Peers {
  std::byte* base[kMaxCudaRanks];
};

// Every rank's tensors of one call, as this rank reaches them (device addresses).
struct DevicePeerTensors {
  const std::byte* x[kMaxCudaRanks];
  const std::uint32_t* scales[kMaxCudaRanks];
  const float* weights[kMaxCudaRanks];
  const std::int64_t* topk[kMaxCudaRanks];
  const std::int32_t* lanes[kMaxCudaRanks];  // combine: expanded row of each (row, lane) at that rank
  std::int64_t x_row[kMaxCudaRanks];         // bytes between rows
  std::int64_t scale_stride0[kMaxCudaRanks], scale_stride1[kMaxCudaRanks];
  std::int64_t weights_row[kMaxCudaRanks];
  std::int64_t topk_row[kMaxCudaRanks];
};

// The sizes of one dispatch or combine, as validated and agreed. The steps copy them into locals
// named by the symbols of docs/semantics.md (N, k, T, R, E, El, P), given beside each member.
struct DeviceGeometry {
  int num_tokens = 0;           // N: this rank's tokens
  int num_topk = 1;             // k
  int max_tokens_per_rank = 1;  // T: tokens per rank the buffer is sized for
  int num_ranks = 1;            // R
  int num_experts = 1;          // E
  int experts_per_rank = 1;     // El
  int rank = 0;                 // this rank
  int scale_columns = 0;        // P: scale columns (FP8)
  int expert_alignment = 1;
  bool expanded_layout = false;  // do_expand: rows grouped by local expert
  std::int64_t row_bytes = 0;    // payload bytes per row
  // Rows a rank can receive.
  std::int64_t receive_capacity() const { return std::int64_t{max_tokens_per_rank} * num_ranks; }
};

// A lane's destination rank, or -1.
MOE_EP_HD inline int rank_of(std::int64_t e, int El) { return e < 0 ? -1 : static_cast<int>(e / El); }

// Where the routing state of a dispatch lives (device arrays of the handle; see DeviceHandleState).
struct RoutingArrays {
  std::int64_t* topk;     // [N, k]
  std::int32_t* dst_slot;  // [N, R]
  std::int32_t* send_base;  // [R]
  std::int32_t* sizes;      // [2]: M, M_exp
  std::int32_t* row_src;    // [cap]
  std::int32_t* row_master;  // [cap]
  std::int32_t* local_ids;   // [cap, k]
  std::int32_t* lane_rows;   // [cap, k]
  std::int32_t* expert_start;  // [El]
  std::int32_t* expert_count;  // [El]
};

// Barrier: signals every peer (its counter for this rank becomes `target`) and waits until every
// peer's counter here reached it. A wait longer than limit_ns records a timeout naming the peer
// and the call's barrier `step` in this rank's error word; nothing waits once that word is set.
template <class Exec>
void signal_and_wait(Exec& exec, const Peers& peers, int me, int R, std::int64_t signals_off, std::uint64_t target,
                     std::uint64_t* error, std::uint64_t limit_ns, int step) {
  const Peers p = peers;
  exec.each(R, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t peer) {
    store_release(reinterpret_cast<std::uint64_t*>(p.base[peer] + signals_off) + me, target);
  });
  exec.each(R, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t peer) {
    std::uint64_t* slot = reinterpret_cast<std::uint64_t*>(p.base[me] + signals_off) + peer;
    const std::uint64_t start = now_ns();
    for (;;) {
      const std::uint64_t seen = load_acquire(slot);
      if (seen >= kLeftSignal) {
        set_first(error, pack_error(ErrorCode::kPeerLeft, static_cast<std::uint32_t>(seen & 0xffff),
                                    static_cast<std::uint32_t>(step), 0));
        return;
      }
      if (seen >= target || load_acquire(error) != 0) return;  // arrived, or this rank already failed
      if (now_ns() - start > limit_ns) {
        set_first(error, pack_error(ErrorCode::kTimeout, static_cast<std::uint32_t>(peer), static_cast<std::uint32_t>(step), 0));
        return;
      }
      pause_between_polls();
    }
  });
}

// Leaves: every peer's counter for this rank becomes kLeftSignal | culprit (after a failure past
// the agreement; culprit: the root cause, this rank or the peer it saw leave), so their waits for
// this rank end at once.
template <class Exec>
void signal_left(Exec& exec, const Peers& peers, int me, int R, std::int64_t signals_off, int culprit) {
  const Peers p = peers;
  const std::uint64_t value = kLeftSignal | static_cast<std::uint64_t>(culprit);
  exec.each(R, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t peer) {
    store_release(reinterpret_cast<std::uint64_t*>(p.base[peer] + signals_off) + me, value);
  });
}

// Clears this rank's error word (status[1]) once the host has taken the error.
template <class Exec>
void clear_error(Exec& exec, std::uint64_t* status) {
  exec.each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) { status[1] = 0; });
}

// Copies rows x cols elements of T from a strided source into a packed destination.
template <class Exec, class T>
void pack(Exec& exec, T* dst, const T* src, std::int64_t rows, std::int64_t cols, std::int64_t s0, std::int64_t s1) {
  exec.each(rows * cols, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) { dst[i] = src[(i / cols) * s0 + (i % cols) * s1]; });
}

// Route: per destination d, this rank's tokens bound for d in ascending order (lists[d * T + slot]),
// their count (counts[d]) and each token's slot (dst_slot[t * R + d], -1 when not bound for d).
// Ids outside [-1, E) and repeated experts are recorded in status[0] (first one) and skipped.
template <class Exec>
void route(Exec& exec, const DeviceGeometry& g, const std::int64_t* topk, std::uint64_t* status, std::int32_t* counts,
           std::int32_t* lists, std::int32_t* dst_slot) {
  const int N = g.num_tokens, k = g.num_topk, R = g.num_ranks, E = g.num_experts, El = g.experts_per_rank;
  const int T = g.max_tokens_per_rank;
  const std::int64_t n = std::int64_t{R} * N + 1;
  auto* const flags = static_cast<std::int32_t*>(exec.temp(static_cast<std::size_t>(n) * 4));
  auto* const pos = static_cast<std::int32_t*>(exec.temp(static_cast<std::size_t>(n) * 4));
  exec.each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) {
    status[0] = 0;
    flags[n - 1] = 0;
  });
  exec.each(N, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t t) {
    const std::int64_t* ids = topk + t * k;
    for (int d = 0; d < R; ++d) flags[d * std::int64_t{N} + t] = 0;
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = ids[j];
      if (e < -1 || e >= E) {
        set_first(status, pack_error(ErrorCode::kExpertOutOfRange, static_cast<std::uint32_t>(t), j, e));
        continue;
      }
      if (e < 0) continue;
      bool twice = false;
      for (int l = 0; l < j; ++l) twice = twice || ids[l] == e;
      if (twice) {
        set_first(status, pack_error(ErrorCode::kDuplicateExpert, static_cast<std::uint32_t>(t), j, e));
        continue;
      }
      flags[rank_of(e, El) * std::int64_t{N} + t] = 1;
    }
  });
  exec.scan(flags, pos, n);
  exec.each(std::int64_t{R} * N, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
    const std::int64_t d = i / N, t = i % N;
    const std::int32_t slot = pos[i] - pos[d * N];
    if (flags[i]) lists[d * T + slot] = static_cast<std::int32_t>(t);
    dst_slot[t * R + d] = flags[i] ? slot : -1;
  });
  exec.each(R, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t d) { counts[d] = pos[(d + 1) * N] - pos[d * N]; });
}

// After the count barrier: the first rank with bad ids (every rank finds the same one) goes into
// this rank's error word; else each source's first row here (base[R + 1]), the rows M (sizes[0]),
// this rank's first row at each destination (send_base) and the inclusive prefix per scale-up
// index (psum_su).
template <class Exec>
void plan_counts(Exec& exec, const DeviceGeometry& g, const Peers& peers, std::int64_t counts_off, std::int64_t status_off,
                 std::uint64_t* status, std::int32_t* base, const RoutingArrays& a, std::int32_t* psum_su) {
  const int R = g.num_ranks, me = g.rank, SU = g.num_ranks;
  const Peers p = peers;
  std::int32_t* const sizes = a.sizes;
  std::int32_t* const send_base = a.send_base;
  exec.each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) {
    // A rank whose barrier ended on an error may be ahead of peers still writing their status.
    for (int r = 0; r < R && load_acquire(status + 1) == 0; ++r) {
      const std::uint64_t w = *reinterpret_cast<const std::uint64_t*>(p.base[r] + status_off);
      if (w != 0) {
        set_first(status + 1, r == me ? w : pack_error(ErrorCode::kPeerRejected, static_cast<std::uint32_t>(r), 0, 0));
        break;
      }
    }
    const bool bad = load_acquire(status + 1) != 0;
    auto count = [&](int src, int dst) {
      return bad ? 0 : reinterpret_cast<const std::int32_t*>(p.base[src] + counts_off)[dst];
    };
    std::int32_t total = 0;
    for (int r = 0; r < SU; ++r) psum_su[r] = 0;
    for (int r = 0; r < R; ++r) {
      base[r] = total;
      total += count(r, me);
      psum_su[r % SU] += count(r, me);
    }
    base[R] = total;
    for (int r = 1; r < SU; ++r) psum_su[r] += psum_su[r - 1];
    sizes[0] = total;
    for (int d = 0; d < R; ++d) {
      std::int32_t b = 0;
      for (int r = 0; r < me; ++r) b += count(r, d);
      send_base[d] = b;
    }
  });
}

// Every received row: its source and token (from the source's list), master lane and local
// experts; then the expert blocks and each lane's expanded row, in receive order within each
// expert: per (local expert, block of kPlanBlock rows) a count, one exact scan over those counts
// (expert-major), and each row's place in its block; the handle's per-expert counts and the
// statistics. Scratch: 8 x local experts x blocks bytes (not per row).
inline constexpr std::int64_t kPlanBlock = 64;

template <class Exec>
void plan_rows(Exec& exec, const DeviceGeometry& g, const Peers& peers, std::int64_t lists_off, const DevicePeerTensors& pt,
               const std::int32_t* base, const RoutingArrays& a, std::int32_t* psum_e, std::int32_t* unaligned,
               std::int32_t* stats) {
  const int k = g.num_topk, T = g.max_tokens_per_rank, El = g.experts_per_rank, me = g.rank, align = g.expert_alignment;
  const bool expand = g.expanded_layout;
  const std::int64_t cap = g.receive_capacity(), S = kPlanBlock, B = core::ceil_div(cap, S), nf = std::int64_t{El} * B + 1;
  auto* const eflag = static_cast<std::int32_t*>(exec.temp(static_cast<std::size_t>(nf) * 4));
  auto* const epos = static_cast<std::int32_t*>(exec.temp(static_cast<std::size_t>(nf) * 4));
  const Peers p = peers;
  const DevicePeerTensors src_t = pt;
  const RoutingArrays r = a;
  exec.each(cap, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
    if (i >= r.sizes[0]) return;
    int src = 0;
    while (base[src + 1] <= i) ++src;
    const std::int32_t t =
        reinterpret_cast<const std::int32_t*>(p.base[src] + lists_off)[std::int64_t{me} * T + (i - base[src])];
    const std::int64_t* ids = src_t.topk[src] + std::int64_t{t} * src_t.topk_row[src];
    r.row_src[i] = src * T + t;
    int master = -1;
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = ids[j];
      const bool here = e >= 0 && rank_of(e, El) == me;
      r.local_ids[i * k + j] = here ? static_cast<std::int32_t>(e - std::int64_t{me} * El) : -1;
      if (here) master = j;
    }
    r.row_master[i] = master;
  });
  // Whether received row i names local expert l (a row names an expert at most once).
  auto names = [=] MOE_EP_HD(std::int64_t i, int l) {
    for (int j = 0; j < k; ++j)
      if (r.local_ids[i * k + j] == l) return true;
    return false;
  };
  exec.each(nf, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t f) {
    if (f == nf - 1) {
      eflag[f] = 0;
      return;
    }
    const int l = static_cast<int>(f / B);
    const std::int64_t first = f % B * S, last = std::min<std::int64_t>(first + S, r.sizes[0]);
    std::int32_t n = 0;
    for (std::int64_t i = first; i < last; ++i) n += names(i, l) ? 1 : 0;
    eflag[f] = n;
  });
  exec.scan(eflag, epos, nf);
  exec.each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) {
    std::int32_t next = 0, psum = 0;
    for (int l = 0; l < El; ++l) {
      const std::int32_t c = epos[(l + 1) * B] - epos[l * B];
      const auto aligned = static_cast<std::int32_t>(core::round_up<std::int64_t>(c, align));
      r.expert_count[l] = c;
      r.expert_start[l] = next;
      unaligned[l] = c;
      psum += aligned;
      psum_e[l] = expand ? next + c : psum;
      next += aligned;
      if (stats) stats[l] += c;
    }
    r.sizes[1] = next;
  });
  exec.each(cap, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
    if (i >= r.sizes[0]) return;
    const std::int64_t b = i / S;
    for (int j = 0; j < k; ++j) {
      const std::int32_t l = r.local_ids[i * k + j];
      if (l < 0) {
        r.lane_rows[i * k + j] = -1;
        continue;
      }
      std::int32_t before = epos[l * B + b] - epos[l * B];  // earlier blocks
      for (std::int64_t q = b * S; q < i; ++q) before += names(q, l) ? 1 : 0;
      r.lane_rows[i * k + j] = r.expert_start[l] + before;
    }
  });
}

// dst_buffer_slot_idx [N, k]: this rank * T + the token's slot at each destination's master lane.
template <class Exec>
void write_slots(Exec& exec, const DeviceGeometry& g, const RoutingArrays& a, std::int32_t* slots) {
  const int k = g.num_topk, R = g.num_ranks, El = g.experts_per_rank, me = g.rank, T = g.max_tokens_per_rank;
  const std::int64_t* const topk = a.topk;
  const std::int32_t* const dst_slot = a.dst_slot;
  exec.each(std::int64_t{g.num_tokens} * k, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
    const std::int64_t t = i / k;
    const int j = static_cast<int>(i % k);
    const int d = rank_of(topk[i], El);
    bool master = d >= 0;
    for (int l = j + 1; l < k && master; ++l) master = rank_of(topk[t * k + l], El) != d;
    slots[i] = master ? me * T + dst_slot[t * R + d] : -1;
  });
}

// The outputs of one dispatch (device pointers; null when absent).
struct DispatchOutputs {
  std::byte* x = nullptr;
  std::uint32_t* scales = nullptr;
  std::int64_t scale_block = 1;  // 1: row-major [rows, P]; else column-major with this column stride
  std::int64_t* ids = nullptr;   // compact only
  float* weights = nullptr;
  std::int32_t* metadata = nullptr;  // non-cached only
  std::int64_t rows = 0;             // rows of ids and metadata (compact rows allocated)
  std::int64_t expanded_rows = 0;
};

// Copies every received row from its source (16 bytes per index), then the row's scales,
// weights, local ids and metadata; rows past the real count get -1 ids and metadata.
template <class Exec>
void pull_rows(Exec& exec, const DeviceGeometry& g, const DevicePeerTensors& pt, const RoutingArrays& a, std::uint64_t* status,
               const DispatchOutputs& o) {
  const int k = g.num_topk, T = g.max_tokens_per_rank, P = g.scale_columns;
  const bool expand = g.expanded_layout;
  const std::int64_t row_bytes = g.row_bytes, chunks = g.row_bytes / 16, scale_block = o.scale_block;
  const DevicePeerTensors src_t = pt;
  const RoutingArrays r = a;
  const DispatchOutputs out = o;
  exec.each(out.rows * chunks, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t idx) {
    const std::int64_t i = idx / chunks, c = idx % chunks;
    if (i >= r.sizes[0] || load_acquire(status + 1) != 0) return;
    const int src = r.row_src[i] / T, t = r.row_src[i] % T;
    const Chunk v = reinterpret_cast<const Chunk*>(src_t.x[src] + std::int64_t{t} * src_t.x_row[src])[c];
    if (!expand) {
      reinterpret_cast<Chunk*>(out.x + i * row_bytes)[c] = v;
      return;
    }
    for (int j = 0; j < k; ++j) {
      const std::int32_t row = r.lane_rows[i * k + j];
      if (row >= 0) reinterpret_cast<Chunk*>(out.x + std::int64_t{row} * row_bytes)[c] = v;
    }
  });
  exec.each(out.rows, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
    if (i >= r.sizes[0] || load_acquire(status + 1) != 0) {
      for (int j = 0; j < k && out.ids; ++j) out.ids[i * k + j] = -1;
      for (int j = 0; j < k + 2 && out.metadata; ++j) out.metadata[i * (k + 2) + j] = -1;
      return;
    }
    const int src = r.row_src[i] / T, t = r.row_src[i] % T;
    const std::uint32_t* sc = out.scales ? src_t.scales[src] + std::int64_t{t} * src_t.scale_stride0[src] : nullptr;
    const float* w = out.weights ? src_t.weights[src] + std::int64_t{t} * src_t.weights_row[src] : nullptr;
    auto put_scales = [&](std::int64_t row) {
      for (int q = 0; q < P && sc; ++q)
        out.scales[scale_block == 1 ? row * P + q : q * scale_block + row] = sc[q * src_t.scale_stride1[src]];
    };
    if (!expand) {
      put_scales(i);
      for (int j = 0; j < k; ++j) out.ids[i * k + j] = r.local_ids[i * k + j];
      for (int j = 0; j < k && w; ++j) out.weights[i * k + j] = w[j];
    } else {
      for (int j = 0; j < k; ++j) {
        const std::int64_t row = r.lane_rows[i * k + j];
        if (row < 0) continue;
        put_scales(row);
        if (w) out.weights[row] = w[j];
      }
    }
    if (out.metadata) {
      std::int32_t* m = out.metadata + i * (k + 2);
      m[0] = r.row_src[i];
      m[1] = src * k + r.row_master[i];
      for (int j = 0; j < k; ++j) m[2 + j] = expand ? r.lane_rows[i * k + j] : -1;
    }
  });
}

// Expanded layout with do_zero_padding: the rows past each expert's count, up to its aligned end,
// are zero (payload, scales, weight).
template <class Exec>
void zero_padding(Exec& exec, const DeviceGeometry& g, const RoutingArrays& a, std::uint64_t* status, const DispatchOutputs& o) {
  const int El = g.experts_per_rank, align = g.expert_alignment, P = g.scale_columns;
  const std::int64_t row_bytes = g.row_bytes, chunks = g.row_bytes / 16, scale_block = o.scale_block;
  const RoutingArrays r = a;
  const DispatchOutputs out = o;
  // Only padding rows: index (expert l, padding row p < align - 1, chunk c), no search per chunk.
  const std::int64_t pad = align - 1;
  exec.each(std::int64_t{El} * pad * chunks, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t idx) {
    const int l = static_cast<int>(idx / (pad * chunks));
    const std::int64_t p = idx / chunks % pad, c = idx % chunks;
    if (load_acquire(status + 1) != 0) return;
    const std::int64_t row = std::int64_t{r.expert_start[l]} + r.expert_count[l] + p;
    if (row >= r.expert_start[l] + core::round_up<std::int64_t>(r.expert_count[l], align)) return;
    reinterpret_cast<Chunk*>(out.x + row * row_bytes)[c] = Chunk{};
    if (c != 0) return;
    for (int q = 0; q < P && out.scales; ++q) out.scales[scale_block == 1 ? row * P + q : q * scale_block + row] = 0;
    if (out.weights) out.weights[row] = 0.0f;
  });
}

// Combine, step 1: every token's inputs in reduction order, as (rank, row) pairs; unit u of
// token t spans inputs [end[u - 1], end[u]) and end[k] holds the unit count. Keys: compact and
// expanded with multiple reduction, one unit per destination rank at its master lane (expanded:
// its lanes ascending); expanded without, one unit per lane.
template <class Exec>
void combine_units(Exec& exec, const DeviceGeometry& g, bool multi, const DevicePeerTensors& pt, const RoutingArrays& a,
                   std::uint64_t* status, std::int64_t* inputs, std::int32_t* unit_end) {
  const int k = g.num_topk, R = g.num_ranks, El = g.experts_per_rank;
  const bool expand = g.expanded_layout;
  const DevicePeerTensors src_t = pt;
  const std::int64_t* const topk = a.topk;
  const std::int32_t* const dst_slot = a.dst_slot;
  const std::int32_t* const send_base = a.send_base;
  exec.each(g.num_tokens, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t t) {
    if (load_acquire(status + 1) != 0) return;  // a failed barrier: peers' lanes may not be ready (nothing is summed)
    const std::int64_t* ids = topk + t * k;
    std::int64_t* in = inputs + t * k;
    std::int32_t* end = unit_end + t * (k + 1);
    int n = 0, units = 0;
    auto row_at = [&](int d) { return std::int64_t{send_base[d] + dst_slot[t * R + d]}; };
    auto input = [&](int d, std::int64_t row) { in[n++] = (std::int64_t{d} << 32) | static_cast<std::uint32_t>(row); };
    for (int j = 0; j < k; ++j) {
      const int d = rank_of(ids[j], El);
      if (d < 0) continue;
      if (expand && !multi) {
        input(d, src_t.lanes[d][row_at(d) * k + j]);
        end[units++] = n;
        continue;
      }
      bool master = true;
      for (int l = j + 1; l < k && master; ++l) master = rank_of(ids[l], El) != d;
      if (!master) continue;
      if (!expand) {
        input(d, row_at(d));
      } else {
        for (int l = 0; l < k; ++l)
          if (rank_of(ids[l], El) == d) input(d, src_t.lanes[d][row_at(d) * k + l]);
      }
      end[units++] = n;
    }
    end[k] = units;
  });
}

// Combine, step 2: out[t] = bf16(sum(bias0, bias1, units...)) in FP32, the first input taken as
// is; a unit of several inputs is their FP32 sum rounded to BF16 (level 1); nothing gives +0.
// Eight elements per index.
template <class Exec>
void combine_sums(Exec& exec, const DeviceGeometry& g, int H, const DevicePeerTensors& pt, const std::int64_t* inputs,
                  const std::int32_t* unit_end, const std::uint16_t* b0, std::int64_t s0, const std::uint16_t* b1,
                  std::int64_t s1, std::uint64_t* status, std::uint16_t* out) {
  const int k = g.num_topk;
  const std::int64_t groups = core::ceil_div(std::int64_t{H}, 8);
  const DevicePeerTensors src_t = pt;
  exec.each(std::int64_t{g.num_tokens} * groups, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t idx) {
    const std::int64_t t = idx / groups, h0 = (idx % groups) * 8;
    const int m = static_cast<int>(H - h0 < 8 ? H - h0 : 8);
    if (load_acquire(status + 1) != 0) return;
    float acc[8], v[8];
    bool started = false;
    auto add = [&] {
      for (int e = 0; e < m; ++e) acc[e] = started ? acc[e] + v[e] : v[e];
      started = true;
    };
    auto load = [&](const std::uint16_t* row) {  // one 16-byte load where the row allows
      if (m == 8 && aligned16(row + h0)) {
        load8_bf16(row + h0, v);
      } else {
        for (int e = 0; e < m; ++e) v[e] = widen_bf16(row[h0 + e]);
      }
    };
    const std::int64_t* in = inputs + t * k;
    auto row_of = [&](int i) {
      const int d = static_cast<int>(in[i] >> 32);
      const std::int64_t r = static_cast<std::int32_t>(in[i] & 0xffffffff);
      return reinterpret_cast<const std::uint16_t*>(src_t.x[d] + r * src_t.x_row[d]);
    };
    if (b0) load(b0 + t * s0), add();
    if (b1) load(b1 + t * s1), add();
    const std::int32_t* end = unit_end + t * (k + 1);
    for (int u = 0, first = 0; u < end[k]; first = end[u++]) {
      if (end[u] - first == 1) {
        load(row_of(first));
      } else {
        float unit[8];
        for (int i = first; i < end[u]; ++i) {
          load(row_of(i));
          for (int e = 0; e < m; ++e) unit[e] = i == first ? v[e] : unit[e] + v[e];
        }
        for (int e = 0; e < m; ++e) v[e] = widen_bf16(narrow_bf16(unit[e]));
      }
      add();
    }
    std::uint16_t result[8];
    for (int e = 0; e < m; ++e) result[e] = started ? narrow_bf16(acc[e]) : 0;
    if (m == 8 && aligned16(out + t * H + h0)) {
      store8_bf16(out + t * H + h0, result);
    } else {
      for (int e = 0; e < m; ++e) out[t * H + h0 + e] = result[e];
    }
  });
}

// Combine, step 3: combined_topk_weights[t, j] = the weight the rank of lane j's expert returned
// for the lane (compact: column j of its row; expanded: its lane row's weight), 0 for id -1.
template <class Exec>
void combine_weights(Exec& exec, const DeviceGeometry& g, const DevicePeerTensors& pt, const RoutingArrays& a, std::uint64_t* status,
                     float* out) {
  const int k = g.num_topk, R = g.num_ranks, El = g.experts_per_rank;
  const bool expand = g.expanded_layout;
  const DevicePeerTensors src_t = pt;
  const std::int64_t* const topk = a.topk;
  const std::int32_t* const dst_slot = a.dst_slot;
  const std::int32_t* const send_base = a.send_base;
  exec.each(std::int64_t{g.num_tokens} * k, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
    if (load_acquire(status + 1) != 0) return;
    const std::int64_t t = i / k;
    const int j = static_cast<int>(i % k), d = rank_of(topk[i], El);
    if (d < 0) {
      out[i] = 0.0f;
      return;
    }
    const std::int64_t row = send_base[d] + dst_slot[t * R + d];
    out[i] = expand ? src_t.weights[d][std::int64_t{src_t.lanes[d][row * k + j]} * src_t.weights_row[d]]
                    : src_t.weights[d][row * src_t.weights_row[d] + j];
  });
}

}  // namespace moe_ep::cuda
