"""The low-latency slab of a rank (V1 low-latency, the dispatcher's low-latency format): per local
expert one block per source rank in rank order, its rows, scales and metadata."""
import numpy as np

from .compare import bitwise
from .formats import f32_to_bf16, swizzled_scales


def check_slab(err, tag, d, sources, El, RN, H, k, wire, recv_x, recv_scales, counts_out, layer,
               src_info=None, layout_range=None, recv_w=None, rank_info=None, expert_out=None):
    """The low-latency slab on rank d: per local expert one block per source rank in rank order,
    tokens in token order, rows 0..count. The metadata arrays are checked where given."""
    where = f"{tag}rank {d}"
    for i in range(El):
        e = d * El + i
        rows = [(s, t) for s, src in enumerate(sources) for t in range(src.n) if e in src.topk[t]]
        cnt = len(rows)
        if counts_out[i] != cnt:
            err.add(f"{where}: expert {i} count {counts_out[i]}, expected {cnt}")
            continue
        if cnt > RN:
            err.add(f"{where}: expert {i} receives {cnt} rows, more than the slab's {RN}")
            continue
        check_metadata(err, where, i, e, rows, sources, RN, src_info, layout_range, recv_w, rank_info)
        check_payload(err, where, i, e, rows, sources, RN, H, wire, recv_x, recv_scales, layer, expert_out)


def check_metadata(err, where, i, e, rows, sources, RN, src_info, layout_range, recv_w, rank_info):
    """Local expert i's (global e) source tokens, per-source ranges, weights and source ranks."""
    cnt = len(rows)
    s_of = np.array([s for s, _ in rows], dtype=np.int64)
    t_of = np.array([t for _, t in rows], dtype=np.int64)
    if src_info is not None:
        expected = np.full(RN, -1, dtype=np.int32)
        expected[:cnt] = t_of
        if not bitwise(src_info[i], expected):
            err.add(f"{where}: packed_recv_src_info of expert {i}")
    if layout_range is not None:
        per_src = np.bincount(s_of, minlength=len(sources)).astype(np.int64)
        begin = np.concatenate([[0], np.cumsum(per_src)[:-1]]).astype(np.int64)
        if not bitwise(layout_range[i], (begin << 32) | per_src):
            err.add(f"{where}: packed_recv_layout_range of expert {i}")
    if recv_w is not None:
        expected = np.zeros(RN, dtype=np.float32)
        expected[:cnt] = [sources[s].w[t][list(sources[s].topk[t]).index(e)] for s, t in rows]
        if not bitwise(recv_w[i], expected):
            err.add(f"{where}: recv_topk_weights of expert {i}")
    if rank_info is not None:
        expected = np.full(RN, -1, dtype=np.int32)
        expected[:cnt] = s_of
        if not bitwise(rank_info[i], expected):
            err.add(f"{where}: recv_rank_info of expert {i}")


def check_payload(err, where, i, e, rows, sources, RN, H, wire, recv_x, recv_scales, layer, expert_out):
    """Local expert i's (global e) rows in their wire cast, their scales and the expert's output."""
    cnt = len(rows)
    if wire == "nvfp4":  # storage [El, rm, rk, 32, 4, 4]: compared byte for byte, zeros included
        sf = np.stack([sources[s].sf[t] for s, t in rows]) if cnt else np.zeros((0, H // 16), np.uint8)
        expected = swizzled_scales(sf, RN, H)
        got = np.ascontiguousarray(recv_scales[i]).view(np.uint8).reshape(-1)
        full = np.zeros(got.size, dtype=np.uint8)  # int32 (UE8M0) storage: the bytes past them are zero
        full[:expected.size] = expected
        if not bitwise(got, full):
            diff = np.nonzero(got != full)[0]
            err.add(f"{where}: swizzled scales of expert {i}: {diff.size} bytes differ (first at {diff[0]})")
    if cnt == 0:
        return
    wire_rows = np.stack([sources[s].bytes[t] for s, t in rows])
    if not bitwise(recv_x[i, :cnt], wire_rows):
        bad = [r for r in range(cnt) if not bitwise(recv_x[i, r], wire_rows[r])]
        err.add(f"{where}: expert {i} slab rows {bad[:8]} differ from the {wire} cast of their tokens")
    if wire == "fp8":  # storage [El, H/128, R*N], token stride 1
        expected = np.stack([sources[s].scales[t] for s, t in rows]).T
        if not bitwise(recv_scales[i][:, :cnt], expected):
            err.add(f"{where}: FP8 scales of expert {i}")
    if expert_out is not None:
        x = np.stack([sources[s].x[t] for s, t in rows])
        expected = f32_to_bf16((x * layer.scale[e] + layer.bias[e]).astype(np.float32))
        if not bitwise(expert_out[i, :cnt], expected):
            err.add(f"{where}: expert_out of expert {i}")
