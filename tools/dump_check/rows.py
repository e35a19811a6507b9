"""Received rows in the compact layout (V2 compact, V1 normal, the dispatcher's normal format) and
the expanded layout (V2 expanded, the dispatcher's V2 expanded format), their per-expert counts,
and the FP8 inputs of a run."""
import numpy as np

from .compare import bitwise
from .formats import F32, cast_fp8


def check_compact(err, tag, d, order_d, sources, k, El, A, recv, recv_scales, recv_idx, recv_w, expert_out, layer,
                  masked_weights, wire):
    """Compact rows (V2 compact, V1 normal, the dispatcher's normal format) on rank d."""
    rows = len(order_d)
    if recv.shape[0] < rows:
        err.add(f"{tag}rank {d}: {recv.shape[0]} received rows, expected at least {rows}")
        return
    for i, (s, t, lanes) in enumerate(order_d):
        src = sources[s]
        if not bitwise(recv[i], src.bytes[t]):
            err.add(f"{tag}rank {d}: received row {i} is not rank {s} token {t}")
        if wire == "fp8" and not bitwise(recv_scales[i], src.scales[t]):
            err.add(f"{tag}rank {d}: received scales row {i} (rank {s} token {t})")
        ids = src.topk[t]
        local = np.array([ids[j] - d * El if j in lanes else -1 for j in range(k)], dtype=np.int64)
        if not bitwise(recv_idx[i], local):
            err.add(f"{tag}rank {d}: received top-k ids row {i}")
        wrow = src.w[t] if not masked_weights else np.where(local >= 0, src.w[t], F32(0)).astype(np.float32)
        if not bitwise(recv_w[i], wrow):
            err.add(f"{tag}rank {d}: received top-k weights row {i}")
        if not bitwise(expert_out[i], layer.compact_row(src.x[t], ids, src.w[t], lanes)):
            err.add(f"{tag}rank {d}: expert_out row {i}")


def expert_counts(order_d, sources, El):
    counts = np.zeros(El, dtype=np.int64)
    for s, t, lanes in order_d:
        for j in lanes:
            counts[sources[s].topk[t][j] % El] += 1
    return counts


def align(n, a):
    return (n + a - 1) // a * a


def expanded_rows(order_d, sources, El, A):
    """(source, token, lane) -> expanded row: groups per local expert at aligned starts, rows in
    (source rank, token) order; also the starts and counts."""
    counts = expert_counts(order_d, sources, El)
    starts = np.concatenate([[0], np.cumsum(align(counts, A))[:-1]]).astype(np.int64)
    nxt = starts.copy()
    rows = {}
    for s, t, lanes in order_d:
        for j in lanes:
            e = sources[s].topk[t][j] % El
            rows[(s, t, j)] = int(nxt[e])
            nxt[e] += 1
    return rows, starts, counts


def check_expanded(err, tag, d, order_d, sources, El, A, recv, recv_scales, recv_w, expert_out, layer, wire):
    rows, starts, counts = expanded_rows(order_d, sources, El, A)
    total = int(starts[-1] + align(counts[-1], A)) if El else 0
    if recv.shape[0] < total:
        err.add(f"{tag}rank {d}: {recv.shape[0]} expanded rows, expected at least {total}")
        return rows, starts, counts
    real = np.zeros(recv.shape[0], dtype=bool)
    for (s, t, j), r in rows.items():
        src = sources[s]
        real[r] = True
        if not bitwise(recv[r], src.bytes[t]) or not bitwise(recv_w[r], src.w[t][j]):
            err.add(f"{tag}rank {d}: expanded row {r} is not rank {s} token {t} lane {j}")
        if wire == "fp8" and not bitwise(recv_scales[r], src.scales[t]):
            err.add(f"{tag}rank {d}: expanded scales row {r}")
        if not bitwise(expert_out[r], layer.lane_row(src.x[t], src.topk[t][j], src.w[t][j])):
            err.add(f"{tag}rank {d}: expert_out expanded row {r}")
    if expert_out[~real].any():
        err.add(f"{tag}rank {d}: expert_out padding rows are not zero")
    return rows, starts, counts


def check_fp8_inputs(err, tag, load, R):
    """The FP8 inputs of the run are the per-128 cast of its BF16 activations."""
    for r in range(R):
        q, sc = cast_fp8(load(r, "x"))
        if not bitwise(load(r, "x_fp8"), q) or not bitwise(load(r, "x_scales"), sc):
            err.add(f"{tag}rank {r}: x_fp8 / x_scales are not the FP8 cast of x")
