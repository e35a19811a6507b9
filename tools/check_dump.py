#!/usr/bin/env python3
"""Checks a `moe-ep run --dump DIR` directory with numpy alone (docs/dump-format.md).

Recomputes, from each rank's inputs and the expert parameters, what every rank must receive
(order, payload, scales, ids, weights, metadata), what its experts must return, and the combined
output of every token with the reduction order of docs/semantics.md, then compares bit for bit.
Exit status 0 when everything matches.
"""
import json
import sys

import numpy as np


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32):
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = ((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000))
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


def sum_rows(rows):
    """FP32 sum in order, the first row as is, one BF16 rounding; one row passes unchanged."""
    if len(rows) == 1:
        return rows[0]
    acc = bf16_to_f32(rows[0]).copy()
    for r in rows[1:]:
        acc = (acc + bf16_to_f32(r)).astype(np.float32)
    return f32_to_bf16(acc)


def main(directory):
    cfg = json.load(open(f"{directory}/config.json"))
    R, H, E, k = cfg["ranks"], cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    T, A, fp8, expand = cfg["num_max_tokens_per_rank"], cfg["expert_alignment"], cfg["fp8"], cfg["expand"]
    multi = cfg["allow_multiple_reduction"]
    nodes = cfg["nodes"] if cfg["allow_hybrid_mode"] else 1
    El, per_node = E // R, R // nodes
    scale = np.load(f"{directory}/expert_scale.npy")
    bias = np.load(f"{directory}/expert_bias.npy")
    table = fp8_table()

    def load(r, name):
        return np.load(f"{directory}/rank{r}_{name}.npy")

    src = []
    for r in range(R):
        d = {"topk": load(r, "topk_idx"), "w": load(r, "topk_weights")}
        if fp8:
            d["bytes"] = load(r, "x_fp8")
            sc = load(r, "x_scales")
            d["scales"] = sc
            d["x"] = (table[d["bytes"]].reshape(-1, H // 128, 128) * sc[:, :, None]).reshape(-1, H).astype(np.float32)
        else:
            d["bytes"] = load(r, "x")
            d["x"] = bf16_to_f32(d["bytes"])
        src.append(d)

    def expert(e, x_row, w):
        acc = np.zeros(H, dtype=np.float32)
        value = (x_row * scale[e] + bias[e]).astype(np.float32)
        return (acc + np.float32(w) * value).astype(np.float32)

    errors = []
    rows_at = {}  # (dest, src, token) -> compact row ; (dest, src, token, lane) -> expanded row
    for d in range(R):
        recv = load(d, "recv_x")
        meta = load(d, "recv_src_metadata")
        recv_w = load(d, "recv_topk_weights")
        out = load(d, "expert_out")
        order = []
        for s in range(R):
            for t in range(src[s]["topk"].shape[0]):
                ids = src[s]["topk"][t]
                lanes = [j for j in range(k) if ids[j] >= 0 and ids[j] // El == d]
                if lanes:
                    order.append((s, t, lanes))
        counts = np.zeros(El, dtype=np.int64)
        for s, t, lanes in order:
            for j in lanes:
                counts[src[s]["topk"][t][j] % El] += 1
        starts = np.concatenate([[0], np.cumsum((counts + A - 1) // A * A)[:-1]])
        nxt = starts.copy()
        for i, (s, t, lanes) in enumerate(order):
            rows_at[(d, s, t)] = i
            if meta[i, 0] != s * T + t or meta[i, 1] != s * k + max(lanes):
                errors.append(f"rank {d}: recv_src_metadata row {i}")
            for j in lanes:
                e = src[s]["topk"][t][j]
                rows_at[(d, s, t, j)] = nxt[e % El]
                nxt[e % El] += 1
            if not expand:
                if not np.array_equal(recv[i], src[s]["bytes"][t]):
                    errors.append(f"rank {d}: recv_x row {i} is not rank {s} token {t}")
                local = np.array([src[s]["topk"][t][j] - d * El if j in lanes else -1 for j in range(k)])
                if not np.array_equal(load(d, "recv_topk_idx")[i], local):
                    errors.append(f"rank {d}: recv_topk_idx row {i}")
                if not np.array_equal(recv_w[i], src[s]["w"][t]):
                    errors.append(f"rank {d}: recv_topk_weights row {i}")
                acc = np.zeros(H, dtype=np.float32)
                for j in lanes:
                    acc = (acc + np.float32(src[s]["w"][t][j]) *
                           (src[s]["x"][t] * scale[src[s]["topk"][t][j]] + bias[src[s]["topk"][t][j]]).astype(np.float32)).astype(np.float32)
                if not np.array_equal(out[i], f32_to_bf16(acc)):
                    errors.append(f"rank {d}: expert_out row {i}")
            else:
                for j in lanes:
                    r = rows_at[(d, s, t, j)]
                    e = src[s]["topk"][t][j]
                    if not np.array_equal(recv[r], src[s]["bytes"][t]) or recv_w[r] != src[s]["w"][t][j]:
                        errors.append(f"rank {d}: expanded row {r} is not rank {s} token {t} lane {j}")
                    if not np.array_equal(out[r], f32_to_bf16(expert(e, src[s]["x"][t], src[s]["w"][t][j]))):
                        errors.append(f"rank {d}: expert_out expanded row {r}")
        if len(errors) > 20:
            break

    for s in range(R):
        combined = load(s, "combined_x")
        combined_w = load(s, "combined_topk_weights")
        for t in range(src[s]["topk"].shape[0]):
            ids = src[s]["topk"][t]
            valid = [j for j in range(k) if ids[j] >= 0]
            master = {}
            for j in valid:
                master[ids[j] // El] = j  # highest lane wins

            def unit_of_rank(d):
                if not expand:
                    return load(d, "expert_out")[rows_at[(d, s, t)]]
                lanes = [j for j in valid if ids[j] // El == d]
                return sum_rows([load(d, "expert_out")[rows_at[(d, s, t, j)]] for j in lanes])

            ranks = sorted(master, key=lambda d: master[d])
            if expand and not multi:
                units = [load(ids[j] // El, "expert_out")[rows_at[(ids[j] // El, s, t, j)]] for j in valid]
            elif nodes > 1 and multi:
                node_master = {}
                for j in valid:
                    node_master[ids[j] // El // per_node] = j
                units = [sum_rows([unit_of_rank(d) for d in ranks if d // per_node == g])
                         for g in sorted(node_master, key=lambda g: node_master[g])]
            else:
                units = [unit_of_rank(d) for d in ranks]
            expected = sum_rows(units) if units else np.zeros(H, dtype=np.uint16)
            if not np.array_equal(combined[t], expected):
                errors.append(f"rank {s}: combined_x token {t}")
            expected_w = np.where(ids >= 0, src[s]["w"][t], 0).astype(np.float32)
            if not np.array_equal(combined_w[t], expected_w):
                errors.append(f"rank {s}: combined_topk_weights token {t}")
            if len(errors) > 20:
                break

    if errors:
        print("check_dump: MISMATCH\n  " + "\n  ".join(errors[:20]))
        return 1
    print(f"check_dump: {directory}: dispatch order and payloads, expert outputs and combined outputs of {R} ranks "
          "match (numpy recomputation)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
