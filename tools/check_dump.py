#!/usr/bin/env python3
"""Checks a `moe-ep run --dump DIR` directory with numpy alone (docs/dump-format.md).

Recomputes, from each rank's inputs and the expert parameters, what every rank must receive
(order, payload, wire casts, scales and their storage, ids, weights, metadata), what its experts
must return, and the combined output of every token with the reduction order of the API
(docs/semantics.md, docs/legacy.md, docs/dispatcher.md), then compares bit for bit. Expectations
are derived from the inputs only, never from the outputs under test.

config.json's "api" selects the checks: "v2" (ElasticBuffer), "v1" (Buffer, normal mode),
"v1_low_latency" (Buffer, low-latency mode, BF16 / FP8 / NVFP4 dispatch, BF16 or LogFMT combine)
or "dispatcher" (every batch of a `moe-ep run --dispatcher` sequence, per its output format).
Exit status 0 when everything matches, 1 on a mismatch, 2 when the dump cannot be checked.
"""
import json
import os
import sys


def use_c_library_log2_exp2():
    """LogFMT is defined with the C library's log2f and exp2f (docs/quantized-formats.md). numpy
    computes float32 log2 and exp2 with them too, except in its AVX-512 kernels, which round some
    results differently: keep numpy on its baseline kernels where the CPU has AVX-512 (before
    numpy is imported; a value the caller set is kept)."""
    if "NPY_DISABLE_CPU_FEATURES" in os.environ:
        return
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return
    names = {"avx512f": "AVX512F", "avx512cd": "AVX512CD"}
    wanted = [names[f] for f in ("avx512f", "avx512cd") if f in flags]
    groups = [("AVX512_SKX", {"avx512vl", "avx512bw", "avx512dq"}), ("AVX512_CLX", {"avx512_vnni"}),
              ("AVX512_CNL", {"avx512ifma", "avx512vbmi"}), ("AVX512_ICL", {"avx512_vbmi2", "avx512_bitalg",
                                                                        "avx512_vpopcntdq"})]
    for name, needed in groups:
        if "avx512f" in flags and needed <= set(flags):
            wanted.append(name)
    if wanted:
        os.environ["NPY_DISABLE_CPU_FEATURES"] = " ".join(wanted)


use_c_library_log2_exp2()
import numpy as np  # noqa: E402  (after the CPU features are chosen)

F32 = np.float32
MAX_ERRORS = 20


class Mismatches(Exception):
    pass


class Errors:
    def __init__(self):
        self.items = []

    def add(self, text):
        self.items.append(text)
        if len(self.items) >= MAX_ERRORS:
            raise Mismatches()


# ---- numeric formats ------------------------------------------------------------------------

def bf16_to_f32(u16):
    return (np.asarray(u16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32):
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def fp8_table():
    values = np.zeros(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 15, code & 7
        if e == 15 and m == 7:
            values[code] = np.nan
        elif e == 0:
            values[code] = sign * m * 2.0 ** -9
        else:
            values[code] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return values


FP8_VALUES = fp8_table()
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def f32_to_e4m3(f):
    """float8_e4m3fn code: round to nearest even, saturating at 448, NaN -> 0x7F (with sign)."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32)
    sign = (u >> np.uint32(24)) & np.uint32(0x80)
    mag = u & np.uint32(0x7FFFFFFF)
    normal = ((mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
    # Below 2^-6: |f| * 512 rounded to an integer (adding 2^23 rounds to nearest even).
    sub = (mag.view(np.float32) * F32(512) + F32(8388608)).view(np.uint32) - np.uint32(0x4B000000)
    code = np.where(mag < np.uint32(0x3C800000), sub, normal)
    code = np.where(mag > np.uint32(0x43E00000), np.uint32(0x7E), code)
    code = np.where(mag > np.uint32(0x7F800000), np.uint32(0x7F), code)
    return (sign | code).astype(np.uint8)


def cast_fp8(x_bits, round_scale=False):
    """Per-128 FP8 cast of BF16 rows (moe_ep/convert.hpp): codes [N, H] and scale_inv [N, H/128]."""
    n, h = x_bits.shape
    x = bf16_to_f32(x_bits).reshape(n, h // 128, 128)
    mag = np.abs(x)
    amax = np.where(np.isnan(mag), F32(0), mag).max(axis=2) if n else np.zeros((0, h // 128), np.float32)
    floored = np.maximum(amax, F32(1e-4))
    scale_inv = (floored / F32(448)).astype(np.float32)
    if round_scale:
        u = scale_inv.view(np.uint32)
        u = np.where(u & np.uint32(0x7FFFFF), (u & np.uint32(0xFF800000)) + np.uint32(0x800000), u)
        scale_inv = np.where(np.isfinite(scale_inv), u.view(np.float32), scale_inv)
        scale = (F32(1) / scale_inv).astype(np.float32)
    else:
        scale = (F32(448) / floored).astype(np.float32)
    q = f32_to_e4m3(x * scale[:, :, None]).reshape(n, h)
    return q, scale_inv


def dequant_fp8(q, scale_inv):
    n, h = q.shape
    return (FP8_VALUES[q].reshape(n, h // 128, 128) * scale_inv[:, :, None]).reshape(n, h).astype(np.float32)


def f32_to_e2m1(v, rounding):
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)
    sign = ((u >> np.uint32(28)) & np.uint32(8)).astype(np.uint8)
    m = (u & np.uint32(0x7FFFFFFF)).view(np.float32)
    if rounding == "sm90":
        s2, s8, s32 = F32(1.41421356237309505), F32(2.82842712474619010), F32(5.65685424949238020)
        code = np.select([m < F32(0.5), m < F32(1), m < F32(2), m < F32(4)],
                         [0, 1, np.where(m > s2, 3, 2), np.where(m > s8, 5, 4)], np.where(m > s32, 7, 6))
    else:  # nearest_even: midpoints, ties to the even code
        code = ((m > F32(0.25)).astype(np.int32) + (m >= F32(0.75)) + (m > F32(1.25)) + (m >= F32(1.75)) +
                (m > F32(2.5)) + (m >= F32(3.5)) + (m > F32(5.0)))
    code = np.where(np.isnan(m), 7, code).astype(np.uint8)
    return sign | code


def f32_to_ue8m0_ceil(f):
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    e = u >> np.uint32(23)
    b = np.minimum(e + ((u & np.uint32(0x7FFFFF)) != 0), 254)
    b = np.where(e == 0, np.where(u <= np.uint32(1 << 22), 0, 1), b)
    b = np.where(e == 255, 254, b)
    b = np.where(np.asarray(f) >= 0, b, 255)  # NaN or negative
    return b.astype(np.uint8)


def cast_nvfp4(x_bits, ue8m0, gs, rounding):
    """NVFP4 row cast (docs/quantized-formats.md): packed [N, H/2], block scales [N, H/16], the
    dequantized values [N, H] (the experts' input)."""
    n, h = x_bits.shape
    x = bf16_to_f32(x_bits).reshape(n, h // 16, 16)
    a = np.abs(x)
    vmax = np.where(np.isnan(a), F32(0), a).max(axis=2) if n else np.zeros((0, h // 16), np.float32)
    r6 = F32(1) / F32(6)
    if ue8m0:
        sf = f32_to_ue8m0_ceil(vmax * r6)
        out_scale = np.where(sf == 0, F32(1), np.ldexp(F32(1), 127 - sf.astype(np.int32)).astype(np.float32))
    else:
        gs = F32(gs)
        sf = f32_to_e4m3(gs * (vmax * r6))
        sf_q = FP8_VALUES[sf]
        with np.errstate(divide="ignore"):
            out_scale = np.where(sf_q != 0, F32(1) / (sf_q * (F32(1) / gs)), F32(0)).astype(np.float32)
    codes = f32_to_e2m1(x * out_scale[:, :, None], rounding).reshape(n, h)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    values = E2M1_VALUES[codes].reshape(n, h // 16, 16)
    if ue8m0:
        deq = np.ldexp(values, sf.astype(np.int32)[:, :, None] - 127).astype(np.float32)
    else:
        deq = (values * FP8_VALUES[sf][:, :, None] / F32(gs)).astype(np.float32)
    return packed, sf, deq.reshape(n, h)


def swizzled_scales(sf_rows, rows_total, h):
    """One expert's scale bytes in the 128 x 4 swizzled storage [rm, rk, 32, 4, 4] (flattened),
    rows 0..len(sf_rows) filled, every other byte zero."""
    rm, rk = (rows_total + 127) // 128, (h + 63) // 64
    out = np.zeros(rm * rk * 512, dtype=np.uint8)
    n = sf_rows.shape[0]
    if n:
        t = np.arange(n)[:, None]
        j = np.arange(h // 16)[None, :]
        off = ((t // 128) * rk + j // 4) * 512 + (t % 32) * 16 + ((t % 128) // 32) * 4 + j % 4
        out[off] = sf_rows
    return out


def logfmt_roundtrip(y_bits):
    """What LogFMT-10 decodes BF16 rows [M, H] to (FP32), docs/quantized-formats.md: per
    128-channel block (amax, amin), castable chunks of 256*U elements coded, the rest BF16."""
    m, h = y_bits.shape
    nb = h // 128
    chunk = 256 * (4 if h % 1024 == 0 else 2)
    bits = y_bits.astype(np.uint16)
    mag = (bits & np.uint16(0x7FFF)).reshape(m, nb, 128)
    amax = mag.max(axis=2)
    amin = np.minimum(mag.min(axis=2), np.uint16(0x7F80))
    amax = np.where(amax > 0x7F80, np.uint16(0x7FC0), amax)
    amax_f, amin_f = bf16_to_f32(amax), bf16_to_f32(amin)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        la = np.log2(amax_f)
        floor_ln = la - F32(32)
        log_amin = np.log2(amin_f)
        ln = np.where(amin_f == 0, floor_ln, np.where(log_amin < floor_ln, floor_ln, log_amin))
        castable = (la < 0) & (ln < la)
        step = (la - ln) / F32(510)
        r = F32(2) - np.log2((F32(1) + np.exp2(step)) / F32(2)) / step
        block_chunk = np.arange(nb) * 128 // chunk
        chunk_ok = np.ones((m, block_chunk[-1] + 1), dtype=bool)
        for c in range(block_chunk[-1] + 1):
            chunk_ok[:, c] = castable[:, block_chunk == c].all(axis=1)
        coded = chunk_ok[:, block_chunk]  # [m, nb]
        v = bf16_to_f32(mag)  # [m, nb, 128]
        st, lnb, rb = step[:, :, None], ln[:, :, None], r[:, :, None]
        t = np.log2(v) / st + rb - lnb / st
        code = np.floor(np.where(t < 0, F32(0), t))
        code = np.where(code >= F32(511), F32(511), code)
        code = np.where(v == 0, F32(0), code)
        code = np.where(coded[:, :, None], code, F32(0)).astype(np.int32)
        decoded = np.where(code == 0, F32(0), np.exp2((code - 1).astype(np.float32) * st + lnb)).astype(np.float32)
    negative = (bits.reshape(m, nb, 128) >> 15).astype(bool)
    decoded = np.where(negative, -decoded, decoded)
    plain = bf16_to_f32(bits).reshape(m, nb, 128)
    return np.where(coded[:, :, None], decoded, plain).reshape(m, h).astype(np.float32), code.reshape(m, h), coded


def sum_rows(rows):
    """FP32 sum in order, the first row as is, one BF16 rounding; one row passes unchanged."""
    if len(rows) == 1:
        return rows[0]
    acc = bf16_to_f32(rows[0]).copy()
    for r in rows[1:]:
        acc = (acc + bf16_to_f32(r)).astype(np.float32)
    return f32_to_bf16(acc)


# ---- the layer ------------------------------------------------------------------------------

class Layer:
    """The expert parameters and what the experts compute (tools/moe_layer.hh)."""

    def __init__(self, directory):
        self.scale = np.load(f"{directory}/expert_scale.npy")
        self.bias = np.load(f"{directory}/expert_bias.npy")

    def value(self, e, x_row):
        return (x_row * self.scale[e] + self.bias[e]).astype(np.float32)

    def compact_row(self, x_row, ids, weights, lanes):
        """bf16(sum over the lanes, ascending, of w_j * f_ej(x)), from a zero accumulator."""
        acc = np.zeros(x_row.shape[0], dtype=np.float32)
        for j in lanes:
            acc = (acc + F32(weights[j]) * self.value(ids[j], x_row)).astype(np.float32)
        return f32_to_bf16(acc)

    def lane_row(self, x_row, e, w, weighted_after_rounding=False):
        """Expanded lane: bf16(w * f(x)); or bf16(w * bf16(f(x))) (the dispatcher's V2 low-latency lanes)."""
        if weighted_after_rounding:
            return f32_to_bf16(F32(w) * bf16_to_f32(f32_to_bf16(self.value(e, x_row))))
        acc = np.zeros(x_row.shape[0], dtype=np.float32)
        return f32_to_bf16((acc + F32(w) * self.value(e, x_row)).astype(np.float32))


class Source:
    """One rank's batch: ids, weights, the wire bytes and the values the experts see."""

    def __init__(self, x_bits, topk, w, wire, fp8_bytes=None, fp8_scales=None, round_scale=False,
                 nvfp4=None):
        self.x_bits, self.topk, self.w = x_bits, topk, w
        self.n = topk.shape[0]
        self.scales = self.sf = None
        if wire == "fp8":
            if fp8_bytes is None:
                fp8_bytes, fp8_scales = cast_fp8(x_bits, round_scale)
            self.bytes, self.scales = fp8_bytes, fp8_scales
            self.x = dequant_fp8(fp8_bytes, fp8_scales)
        elif wire == "nvfp4":
            self.bytes, self.sf, self.x = cast_nvfp4(x_bits, *nvfp4)
        else:
            self.bytes = x_bits
            self.x = bf16_to_f32(x_bits)


def routing(sources, R, El, k):
    """Per destination rank: the rows it receives in order (source rank, then token), each
    (source, token, local lanes)."""
    order = [[] for _ in range(R)]
    for s, src in enumerate(sources):
        for t in range(src.n):
            ids = src.topk[t]
            for d in range(R):
                lanes = [j for j in range(k) if ids[j] >= 0 and ids[j] // El == d]
                if lanes:
                    order[d].append((s, t, lanes))
    return order


def reduce_token(ids, k, El, unit_of_rank, lane_unit, expand, multi, nodes, per_node):
    """The combine of one token from its units (docs/semantics.md §4): ranks ordered by master
    lane (the highest lane of the rank), across nodes with multiple reduction summed per node
    first (nodes ordered by their master lane), expanded without multiple reduction lane by lane."""
    valid = [j for j in range(k) if ids[j] >= 0]
    master = {}
    for j in valid:
        master[ids[j] // El] = j
    ranks = sorted(master, key=lambda d: master[d])
    if expand and not multi:
        units = [lane_unit(j) for j in valid]
    elif nodes > 1 and multi:
        node_master = {}
        for j in valid:
            node_master[ids[j] // El // per_node] = j
        units = [sum_rows([unit_of_rank(d) for d in ranks if d // per_node == g])
                 for g in sorted(node_master, key=lambda g: node_master[g])]
    else:
        units = [unit_of_rank(d) for d in ranks]
    return units


def combine_expected(src, t, layer, k, El, expand, multi, nodes, per_node, weighted_after_rounding=False):
    ids, w, x = src.topk[t], src.w[t], src.x[t]
    lane_cache = {}

    def lane(j):
        if j not in lane_cache:
            lane_cache[j] = layer.lane_row(x, ids[j], w[j], weighted_after_rounding)
        return lane_cache[j]

    def unit_of_rank(d):
        lanes = [j for j in range(k) if ids[j] >= 0 and ids[j] // El == d]
        if not expand:
            return layer.compact_row(x, ids, w, lanes)
        return sum_rows([lane(j) for j in lanes])

    units = reduce_token(ids, k, El, unit_of_rank, lane, expand, multi, nodes, per_node)
    return sum_rows(units) if units else np.zeros(x.shape[0], dtype=np.uint16)


def low_latency_combine_expected(src, t, layer, k, logfmt):
    """V1 low-latency combine: bf16(sum over valid lanes, ascending, of w_j * y_j), FP32, the first
    product as is; y_j the unweighted BF16 expert row (or what its LogFMT encoding decodes to)."""
    ids, w, x = src.topk[t], src.w[t], src.x[t]
    valid = [j for j in range(k) if ids[j] >= 0]
    if not valid:
        return np.zeros(x.shape[0], dtype=np.uint16)
    rows = np.stack([f32_to_bf16(layer.value(ids[j], x)) for j in valid])
    lanes = logfmt_roundtrip(rows)[0] if logfmt else bf16_to_f32(rows)
    acc = None
    for i, j in enumerate(valid):
        p = (F32(w[j]) * lanes[i]).astype(np.float32)
        acc = p if acc is None else (acc + p).astype(np.float32)
    return f32_to_bf16(acc)


# ---- checks shared by the APIs --------------------------------------------------------------

def bitwise(a, b):
    """Equal shapes and bits (float32 compared as bits, so -0 and NaN payloads count)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    return np.array_equal(a, b)


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


def check_slab(err, tag, d, sources, El, RN, H, k, wire, recv_x, recv_scales, counts_out, layer,
               src_info=None, layout_range=None, recv_w=None, rank_info=None, expert_out=None):
    """The low-latency slab on rank d: per local expert one block per source rank in rank order,
    tokens in token order, rows 0..count."""
    R = len(sources)
    for i in range(El):
        e = d * El + i
        rows = [(s, t) for s, src in enumerate(sources) for t in range(src.n) if e in src.topk[t]]
        cnt = len(rows)
        if counts_out[i] != cnt:
            err.add(f"{tag}rank {d}: expert {i} count {counts_out[i]}, expected {cnt}")
            continue
        if cnt > RN:
            err.add(f"{tag}rank {d}: expert {i} receives {cnt} rows, more than the slab's {RN}")
            continue
        s_of = np.array([s for s, _ in rows], dtype=np.int64)
        t_of = np.array([t for _, t in rows], dtype=np.int64)
        if src_info is not None:
            expected = np.full(RN, -1, dtype=np.int32)
            expected[:cnt] = t_of
            if not bitwise(src_info[i], expected):
                err.add(f"{tag}rank {d}: packed_recv_src_info of expert {i}")
        if layout_range is not None:
            per_src = np.bincount(s_of, minlength=R).astype(np.int64)
            begin = np.concatenate([[0], np.cumsum(per_src)[:-1]]).astype(np.int64)
            if not bitwise(layout_range[i], (begin << 32) | per_src):
                err.add(f"{tag}rank {d}: packed_recv_layout_range of expert {i}")
        if recv_w is not None:
            expected = np.zeros(RN, dtype=np.float32)
            expected[:cnt] = [sources[s].w[t][list(sources[s].topk[t]).index(e)] for s, t in rows]
            if not bitwise(recv_w[i], expected):
                err.add(f"{tag}rank {d}: recv_topk_weights of expert {i}")
        if rank_info is not None:
            expected = np.full(RN, -1, dtype=np.int32)
            expected[:cnt] = s_of
            if not bitwise(rank_info[i], expected):
                err.add(f"{tag}rank {d}: recv_rank_info of expert {i}")
        if wire == "nvfp4":  # storage [El, rm, rk, 32, 4, 4]: compared byte for byte, zeros included
            sf = np.stack([sources[s].sf[t] for s, t in rows]) if cnt else np.zeros((0, H // 16), np.uint8)
            expected = swizzled_scales(sf, RN, H)
            got = np.ascontiguousarray(recv_scales[i]).view(np.uint8).reshape(-1)
            full = np.zeros(got.size, dtype=np.uint8)  # int32 (UE8M0) storage: the bytes past them are zero
            full[:expected.size] = expected
            if not bitwise(got, full):
                diff = np.nonzero(got != full)[0]
                err.add(f"{tag}rank {d}: swizzled scales of expert {i}: {diff.size} bytes differ (first at {diff[0]})")
        if cnt == 0:
            continue
        wire_rows = np.stack([sources[s].bytes[t] for s, t in rows])
        if not bitwise(recv_x[i, :cnt], wire_rows):
            bad = [r for r in range(cnt) if not bitwise(recv_x[i, r], wire_rows[r])]
            err.add(f"{tag}rank {d}: expert {i} slab rows {bad[:8]} differ from the {wire} cast of their tokens")
        if wire == "fp8":  # storage [El, H/128, R*N], token stride 1
            expected = np.stack([sources[s].scales[t] for s, t in rows]).T
            if not bitwise(recv_scales[i][:, :cnt], expected):
                err.add(f"{tag}rank {d}: FP8 scales of expert {i}")
        if expert_out is not None:
            x = np.stack([sources[s].x[t] for s, t in rows])
            expected = f32_to_bf16((x * layer.scale[e] + layer.bias[e]).astype(np.float32))
            if not bitwise(expert_out[i, :cnt], expected):
                err.add(f"{tag}rank {d}: expert_out of expert {i}")


# ---- the APIs ---------------------------------------------------------------------------------

def check_v2(directory, cfg, err):
    R, H, E, k = cfg["ranks"], cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    T, A, fp8, expand = cfg["num_max_tokens_per_rank"], cfg["expert_alignment"], cfg["fp8"], cfg["expand"]
    multi = cfg["allow_multiple_reduction"]
    nodes = cfg["nodes"] if cfg["allow_hybrid_mode"] else 1
    El, per_node = E // R, R // nodes
    layer = Layer(directory)
    load = lambda r, name: np.load(f"{directory}/rank{r}_{name}.npy")
    if fp8:
        check_fp8_inputs(err, "", load, R)
    sources = [load_source(load, r, "fp8" if fp8 else "bf16") for r in range(R)]
    order = routing(sources, R, El, k)
    rows = {}
    for d in range(R):
        recv, recv_w, out = load(d, "recv_x"), load(d, "recv_topk_weights"), load(d, "expert_out")
        sc = load(d, "recv_x_scales") if fp8 else None
        meta, psum = load(d, "recv_src_metadata"), load(d, "psum_num_recv_tokens_per_expert")
        counts = expert_counts(order[d], sources, El)
        if expand:
            rows, starts, counts = check_expanded(err, "", d, order[d], sources, El, A, recv, sc, recv_w, out, layer,
                                                  "fp8" if fp8 else "bf16")
            expected_psum = starts + counts
        else:
            check_compact(err, "", d, order[d], sources, k, El, A, recv, sc, load(d, "recv_topk_idx"), recv_w, out,
                          layer, False, "fp8" if fp8 else "bf16")
            expected_psum = np.cumsum(align(counts, A))
        if not bitwise(psum, expected_psum.astype(np.int32)):
            err.add(f"rank {d}: psum_num_recv_tokens_per_expert {psum.tolist()}, expected {expected_psum.tolist()}")
        for i, (s, t, lanes) in enumerate(order[d]):
            expected = [s * T + t, s * k + max(lanes)] + [rows[(s, t, j)] if expand and j in lanes else -1
                                                          for j in range(k)]
            if not bitwise(meta[i], np.array(expected, dtype=np.int32)):
                err.add(f"rank {d}: recv_src_metadata row {i}: {meta[i].tolist()}, expected {expected}")
    for s, src in enumerate(sources):
        combined, combined_w = load(s, "combined_x"), load(s, "combined_topk_weights")
        for t in range(src.n):
            if not bitwise(combined[t], combine_expected(src, t, layer, k, El, expand, multi, nodes, per_node)):
                err.add(f"rank {s}: combined_x token {t}")
            expected_w = np.where(src.topk[t] >= 0, src.w[t], F32(0)).astype(np.float32)
            if not bitwise(combined_w[t], expected_w):
                err.add(f"rank {s}: combined_topk_weights token {t}")
    return f"V2 dispatch order and payloads, metadata, expert outputs and combined outputs of {R} ranks"


def load_source(load, r, wire, nvfp4=None, round_scale=False):
    x = load(r, "x")
    if wire == "fp8" and nvfp4 is None and not round_scale:
        try:
            q, sc = load(r, "x_fp8"), load(r, "x_scales")
        except FileNotFoundError:
            q = sc = None
        if q is not None:
            return Source(x, load(r, "topk_idx"), load(r, "topk_weights"), wire, q, sc)
    return Source(x, load(r, "topk_idx"), load(r, "topk_weights"), wire, round_scale=round_scale, nvfp4=nvfp4)


def check_fp8_inputs(err, tag, load, R):
    """The FP8 inputs of the run are the per-128 cast of its BF16 activations."""
    for r in range(R):
        q, sc = cast_fp8(load(r, "x"))
        if not bitwise(load(r, "x_fp8"), q) or not bitwise(load(r, "x_scales"), sc):
            err.add(f"{tag}rank {r}: x_fp8 / x_scales are not the FP8 cast of x")


def check_v1(directory, cfg, err):
    R, H, E, k = cfg["ranks"], cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    A, fp8 = cfg["expert_alignment"], cfg["fp8"]
    nodes = cfg["nodes"]
    El, per_node = E // R, R // nodes
    layer = Layer(directory)
    load = lambda r, name: np.load(f"{directory}/rank{r}_{name}.npy")
    wire = "fp8" if fp8 else "bf16"
    if fp8:
        check_fp8_inputs(err, "", load, R)
    sources = [load_source(load, r, wire) for r in range(R)]
    order = routing(sources, R, El, k)
    sent = np.zeros((R, R), dtype=np.int64)  # [s][d] tokens s sends to d
    for d in range(R):
        for s, t, lanes in order[d]:
            sent[s, d] += 1
    prefix = np.cumsum(sent, axis=0).astype(np.int32)
    for d in range(R):
        recv, recv_w, out = load(d, "recv_x"), load(d, "recv_topk_weights"), load(d, "expert_out")
        rows = len(order[d])
        if recv.shape[0] != rows:
            err.add(f"rank {d}: {recv.shape[0]} received rows, expected {rows}")
            continue
        check_compact(err, "", d, order[d], sources, k, El, A, recv, load(d, "recv_x_scales") if fp8 else None,
                      load(d, "recv_topk_idx"), recv_w, out, layer, True, wire)
        if not bitwise(load(d, "recv_src_idx"), np.array([t for _, t, _ in order[d]], dtype=np.int32)):
            err.add(f"rank {d}: recv_src_idx")
        if not bitwise(load(d, "rank_prefix_matrix"), prefix):
            err.add(f"rank {d}: rank_prefix_matrix")
        counts = align(expert_counts(order[d], sources, El), A)
        if not bitwise(load(d, "num_recv_tokens_per_expert_list"), counts.astype(np.int32)):
            err.add(f"rank {d}: num_recv_tokens_per_expert_list {load(d, 'num_recv_tokens_per_expert_list').tolist()}, "
                    f"expected {counts.tolist()}")
        # The source side of rank d's tokens.
        src = sources[d]
        in_rank = np.zeros((src.n, R), dtype=bool)
        head = np.full((src.n, R), -1, dtype=np.int32)
        next_slot = np.zeros(R, dtype=np.int32)
        for t in range(src.n):
            for r in sorted({int(e) // El for e in src.topk[t] if e >= 0}):
                in_rank[t, r] = True
                head[t, r] = next_slot[r]
                next_slot[r] += 1
        if not bitwise(load(d, "is_token_in_rank"), in_rank):
            err.add(f"rank {d}: is_token_in_rank")
        if not bitwise(load(d, "send_head"), head):
            err.add(f"rank {d}: send_head")
    for s, src in enumerate(sources):
        combined, combined_w = load(s, "combined_x"), load(s, "combined_topk_weights")
        for t in range(src.n):
            # V1 across nodes: the forwarder sums its node first (the hybrid order with multiple reduction).
            if not bitwise(combined[t], combine_expected(src, t, layer, k, El, False, True, nodes, per_node)):
                err.add(f"rank {s}: combined_x token {t}")
            # The sum, in unit order, of the weight rows the ranks returned (0 where not local).
            ids = src.topk[t]

            def weight_row(d):
                return np.where((ids >= 0) & (ids // El == d), src.w[t], F32(0)).astype(np.float32)

            def fsum(rows):
                acc = rows[0].copy()
                for r in rows[1:]:
                    acc = (acc + r).astype(np.float32)
                return acc

            valid = [j for j in range(k) if ids[j] >= 0]
            master = {}
            for j in valid:
                master[ids[j] // El] = j
            ranks = sorted(master, key=lambda d: master[d])
            if nodes > 1:
                node_master = {}
                for j in valid:
                    node_master[ids[j] // El // per_node] = j
                units = [fsum([weight_row(d) for d in ranks if d // per_node == g])
                         for g in sorted(node_master, key=lambda g: node_master[g])]
            else:
                units = [weight_row(d) for d in ranks]
            expected_w = fsum(units) if units else np.zeros(k, dtype=np.float32)
            if not bitwise(combined_w[t], expected_w):
                err.add(f"rank {s}: combined_topk_weights token {t}")
    return (f"V1 normal-mode order and payloads, ids, weights, handle (rank_prefix_matrix, recv_src_idx, "
            f"is_token_in_rank, send_head), expert counts, expert outputs and combined outputs of {R} ranks")


def nvfp4_params(cfg, ue8m0_key="nvfp4_ue8m0"):
    rounding = cfg.get("nvfp4_rounding") or "nearest_even"
    if rounding not in ("nearest_even", "sm90"):
        raise ValueError(f"nvfp4_rounding '{rounding}' is neither nearest_even nor sm90")
    return (bool(cfg[ue8m0_key]), cfg["nvfp4_global_scale"], rounding)


def check_low_latency(directory, cfg, err):
    R, H, E, k, N = cfg["ranks"], cfg["hidden"], cfg["num_experts"], cfg["num_topk"], cfg["num_max_tokens_per_rank"]
    El, RN = E // R, R * N
    wire = "nvfp4" if cfg["nvfp4"] else "fp8" if cfg["fp8"] else "bf16"
    logfmt = cfg["logfmt"]
    layer = Layer(directory)
    load = lambda r, name: np.load(f"{directory}/rank{r}_{name}.npy")
    nv = nvfp4_params(cfg) if wire == "nvfp4" else None
    sources = [Source(load(r, "x"), load(r, "topk_idx"), load(r, "topk_weights"), wire, nvfp4=nv) for r in range(R)]
    for d in range(R):
        check_slab(err, "", d, sources, El, RN, H, k, wire, load(d, "recv_x"),
                   load(d, "recv_x_scales") if wire != "bf16" else None, load(d, "packed_recv_count"), layer,
                   src_info=load(d, "packed_recv_src_info"), layout_range=load(d, "packed_recv_layout_range"),
                   recv_w=load(d, "recv_topk_weights"), rank_info=load(d, "recv_rank_info"),
                   expert_out=load(d, "expert_out"))
    for s, src in enumerate(sources):
        combined = load(s, "combined_x")
        for t in range(src.n):
            if not bitwise(combined[t], low_latency_combine_expected(src, t, layer, k, logfmt)):
                err.add(f"rank {s}: combined_x token {t}" + (" (LogFMT combine)" if logfmt else ""))
    casts = {"bf16": "BF16", "fp8": "FP8 (per-128 scales, token-stride-1 storage)",
             "nvfp4": f"NVFP4 ({'UE8M0' if nv and nv[0] else 'E4M3'} scales, {nv[2] if nv else ''} rounding, "
                      "swizzled scale storage byte for byte)"}
    return (f"V1 low-latency slabs ({casts[wire]}), counts, src_info, layout ranges, received weights and ranks, "
            f"expert outputs and {'LogFMT ' if logfmt else ''}combined outputs of {R} ranks")


def check_dispatcher(directory, cfg, err):
    R, H, E, k = cfg["ranks"], cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    El, nodes_total = E // R, cfg["nodes"]
    A, cap = cfg["expert_alignment"], cfg["num_max_dispatch_tokens_per_rank"]
    if cfg["use_ue8m0"]:
        raise ValueError("FP8 with UE8M0-packed scales (DispatcherOptions.use_ue8m0) is not checked")
    layer = Layer(directory)
    done = []
    for b, batch in enumerate(cfg["batches"]):
        tag = f"batch {b} ({batch['kind']}, {batch['generation']}, {batch['format']}, {batch['wire_dtype']}): "
        load = lambda r, name: np.load(f"{directory}/batch{b}_rank{r}_{name}.npy")
        wire, fmt, gen = batch["wire_dtype"], batch["format"], batch["generation"]
        nv = nvfp4_params(cfg) if wire == "nvfp4" else None
        sources = [Source(load(r, "x"), load(r, "topk_idx"), load(r, "topk_weights"), wire,
                          round_scale=cfg["round_scale"], nvfp4=nv) for r in range(R)]
        for r, src in enumerate(sources):
            if src.n != batch["tokens_per_rank"][r]:
                err.add(f"{tag}rank {r}: {src.n} tokens, config.json says {batch['tokens_per_rank'][r]}")
        if gen == "v1":
            hybrid, multi = True, True  # V1 sums each node at its forwarder first
        else:
            hybrid, multi = cfg["allow_hybrid_mode"], cfg["allow_multiple_reduction"]
        nodes = nodes_total if hybrid else 1
        per_node = R // nodes
        order = routing(sources, R, El, k)
        for d in range(R):
            hs, out = load(d, "hidden_states"), load(d, "expert_out")
            sc = load(d, "hidden_states_scale") if wire != "bf16" else None
            counts = expert_counts(order[d], sources, El)
            if fmt == "normal":
                if hs.shape[0] != len(order[d]):
                    err.add(f"{tag}rank {d}: {hs.shape[0]} rows, expected {len(order[d])}")
                    continue
                check_compact(err, tag, d, order[d], sources, k, El, A, hs, sc, load(d, "topk_ids"),
                              load(d, "recv_topk_weights"), out, layer, True, wire)
                if not bitwise(load(d, "num_recv_tokens_per_expert"), align(counts, A).astype(np.int32)):
                    err.add(f"{tag}rank {d}: num_recv_tokens_per_expert")
            elif fmt == "v2_expanded":
                _, starts, counts = check_expanded(err, tag, d, order[d], sources, El, A, hs, sc,
                                                   load(d, "recv_topk_weights"), out, layer, wire)
                if not bitwise(load(d, "num_recv_tokens_per_expert"), align(counts, A).astype(np.int32)):
                    err.add(f"{tag}rank {d}: num_recv_tokens_per_expert")
                if not bitwise(load(d, "masked_m"), counts.astype(np.int32)):
                    err.add(f"{tag}rank {d}: masked_m")
            elif fmt == "low_latency":
                n_local = sources[d].n
                if batch["expected_m"][d] != (n_local * R * k + E) // E:
                    err.add(f"{tag}rank {d}: expected_m {batch['expected_m'][d]}")
                check_slab(err, tag, d, sources, El, R * cap, H, k, wire, hs, sc, load(d, "masked_m"), layer,
                           expert_out=out)
            else:
                raise ValueError(f"batch {b}: unknown format '{fmt}'")
        for s, src in enumerate(sources):
            combined = load(s, "combined_x")
            for t in range(src.n):
                if fmt == "low_latency" and gen == "v1":
                    expected = low_latency_combine_expected(src, t, layer, k, False)
                else:
                    expected = combine_expected(src, t, layer, k, El, fmt != "normal", multi, nodes, per_node,
                                                weighted_after_rounding=fmt == "low_latency")
                if not bitwise(combined[t], expected):
                    err.add(f"{tag}rank {s}: combined_x token {t}")
        done.append(f"{batch['kind']}/{gen}/{fmt}/{wire}")
    return f"dispatcher batches [{', '.join(done)}] of {R} ranks: delivered rows, expert outputs and combined outputs"


def main(directory):
    try:
        cfg = json.load(open(f"{directory}/config.json"))
    except (OSError, ValueError) as e:
        print(f"check_dump: {directory}: no readable config.json ({e})")
        return 2
    api = cfg.get("api", "v2")
    checks = {"v2": check_v2, "v1": check_v1, "v1_low_latency": check_low_latency, "dispatcher": check_dispatcher}
    if api not in checks:
        print(f"check_dump: {directory}: unknown api '{api}'")
        return 2
    err = Errors()
    try:
        what = checks[api](directory, cfg, err)
    except Mismatches:
        what = None
    except (OSError, ValueError, KeyError) as e:
        print(f"check_dump: {directory}: cannot check this dump: {type(e).__name__}: {e}")
        return 2
    if err.items:
        print(f"check_dump: {directory} (api {api}): MISMATCH\n  " + "\n  ".join(err.items[:MAX_ERRORS]))
        return 1
    print(f"check_dump: {directory}: {what} match (numpy recomputation)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: check_dump.py DUMP_DIR")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
