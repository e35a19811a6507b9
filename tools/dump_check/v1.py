"""api "v1": a Buffer normal-mode dispatch and combine, with the V1 handle."""
import numpy as np

from .compare import bitwise, check_combined
from .expected import Layer, combine_expected, load_source, reduce_token, routing
from .formats import F32
from .rows import align, check_compact, check_fp8_inputs, expert_counts


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
        in_rank, head = send_side(sources[d], R, El)
        if not bitwise(load(d, "is_token_in_rank"), in_rank):
            err.add(f"rank {d}: is_token_in_rank")
        if not bitwise(load(d, "send_head"), head):
            err.add(f"rank {d}: send_head")
    # V1 across nodes: the forwarder sums its node first (the hybrid order with multiple reduction).
    check_combined(err, sources, load,
                   lambda src, t: combine_expected(src, t, layer, k, El, False, True, nodes, per_node),
                   lambda src, t: combined_weights(src, t, k, El, nodes, per_node))
    return (f"V1 normal-mode order and payloads, ids, weights, handle (rank_prefix_matrix, recv_src_idx, "
            f"is_token_in_rank, send_head), expert counts, expert outputs and combined outputs of {R} ranks")


def send_side(src, R, El):
    """The handle's source side of a rank's tokens: is_token_in_rank [N, R] and send_head [N, R],
    the slot of each token among the tokens the rank sends to r (-1 where not sent)."""
    in_rank = np.zeros((src.n, R), dtype=bool)
    head = np.full((src.n, R), -1, dtype=np.int32)
    next_slot = np.zeros(R, dtype=np.int32)
    for t in range(src.n):
        for r in sorted({int(e) // El for e in src.topk[t] if e >= 0}):
            in_rank[t, r] = True
            head[t, r] = next_slot[r]
            next_slot[r] += 1
    return in_rank, head


def combined_weights(src, t, k, El, nodes, per_node):
    """Token t's combined_topk_weights: the FP32 sum, in unit order (the combine's, with the
    forwarder's node sums across nodes), of the weight rows the ranks returned (0 where not local)."""
    ids = src.topk[t]

    def weight_row(d):
        return np.where((ids >= 0) & (ids // El == d), src.w[t], F32(0)).astype(np.float32)

    def fsum(rows):
        acc = rows[0].copy()
        for r in rows[1:]:
            acc = (acc + r).astype(np.float32)
        return acc

    units = reduce_token(ids, k, El, weight_row, None, False, True, nodes, per_node, sum_units=fsum)
    return fsum(units) if units else np.zeros(k, dtype=np.float32)
