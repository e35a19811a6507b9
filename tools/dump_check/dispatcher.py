"""api "dispatcher": every batch of a `moe-ep run --dispatcher` sequence, per its output format."""
import numpy as np

from .compare import bitwise
from .expected import Layer, Source, combine_expected, low_latency_combine_expected, nvfp4_params, routing
from .rows import align, check_compact, check_expanded, expert_counts
from .slab import check_slab


def check_dispatcher(directory, cfg, err):
    R = cfg["ranks"]
    if cfg["use_ue8m0"]:
        raise ValueError("FP8 with UE8M0-packed scales (DispatcherOptions.use_ue8m0) is not checked")
    layer = Layer(directory)
    done = [check_batch(directory, cfg, err, b, batch, layer) for b, batch in enumerate(cfg["batches"])]
    return f"dispatcher batches [{', '.join(done)}] of {R} ranks: delivered rows, expert outputs and combined outputs"


def check_batch(directory, cfg, err, b, batch, layer):
    """Batch b: every rank's delivered rows in the batch's format, then every token's combined row.
    Returns the batch's name (kind/generation/format/wire dtype)."""
    R, E, k = cfg["ranks"], cfg["num_experts"], cfg["num_topk"]
    El = E // R
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
    nodes = cfg["nodes"] if hybrid else 1
    per_node = R // nodes
    order = routing(sources, R, El, k)
    for d in range(R):
        check_delivered(err, tag, cfg, b, batch, d, order[d], sources, load, layer)
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
    return f"{batch['kind']}/{gen}/{fmt}/{wire}"


def check_delivered(err, tag, cfg, b, batch, d, order_d, sources, load, layer):
    """What rank d's experts got in batch b, per the batch's output format, and what they returned."""
    R, H, E, k = cfg["ranks"], cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    El, A, cap = E // R, cfg["expert_alignment"], cfg["num_max_dispatch_tokens_per_rank"]
    wire, fmt = batch["wire_dtype"], batch["format"]
    hs, out = load(d, "hidden_states"), load(d, "expert_out")
    sc = load(d, "hidden_states_scale") if wire != "bf16" else None
    counts = expert_counts(order_d, sources, El)
    if fmt == "normal":
        if hs.shape[0] != len(order_d):
            err.add(f"{tag}rank {d}: {hs.shape[0]} rows, expected {len(order_d)}")
            return
        check_compact(err, tag, d, order_d, sources, k, El, A, hs, sc, load(d, "topk_ids"),
                      load(d, "recv_topk_weights"), out, layer, True, wire)
        if not bitwise(load(d, "num_recv_tokens_per_expert"), align(counts, A).astype(np.int32)):
            err.add(f"{tag}rank {d}: num_recv_tokens_per_expert")
    elif fmt == "v2_expanded":
        _, starts, counts = check_expanded(err, tag, d, order_d, sources, El, A, hs, sc,
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
