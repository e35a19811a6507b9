"""api "v2": an ElasticBuffer dispatch and combine (compact or expanded, FP8 or BF16, hybrid)."""
import numpy as np

from .compare import bitwise, check_combined
from .expected import Layer, combine_expected, load_source, routing
from .formats import F32
from .rows import align, check_compact, check_expanded, check_fp8_inputs, expert_counts


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
    check_combined(err, sources, load,
                   lambda src, t: combine_expected(src, t, layer, k, El, expand, multi, nodes, per_node),
                   lambda src, t: np.where(src.topk[t] >= 0, src.w[t], F32(0)).astype(np.float32))
    return f"V2 dispatch order and payloads, metadata, expert outputs and combined outputs of {R} ranks"
