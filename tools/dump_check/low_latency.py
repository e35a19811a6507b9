"""api "v1_low_latency": a Buffer low-latency dispatch (BF16, FP8 or NVFP4) and combine (BF16 or
LogFMT)."""
import numpy as np

from .compare import bitwise
from .expected import Layer, Source, low_latency_combine_expected, nvfp4_params
from .slab import check_slab


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
