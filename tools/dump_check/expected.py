"""What a dump must hold, derived from its inputs only: the experts' computation (Layer), one
rank's batch with its wire cast (Source), the rows every rank receives in order (routing) and the
combined row of a token with the reduction order of the API (docs/semantics.md §4)."""
import numpy as np

from .formats import F32, bf16_to_f32, cast_fp8, cast_nvfp4, dequant_fp8, f32_to_bf16, logfmt_roundtrip, sum_rows


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


def nvfp4_params(cfg, ue8m0_key="nvfp4_ue8m0"):
    rounding = cfg.get("nvfp4_rounding") or "nearest_even"
    if rounding not in ("nearest_even", "sm90"):
        raise ValueError(f"nvfp4_rounding '{rounding}' is neither nearest_even nor sm90")
    return (bool(cfg[ue8m0_key]), cfg["nvfp4_global_scale"], rounding)


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


def reduce_token(ids, k, El, unit_of_rank, lane_unit, expand, multi, nodes, per_node, sum_units=sum_rows):
    """The combine of one token from its units (docs/semantics.md §4): ranks ordered by master
    lane (the highest lane of the rank), across nodes with multiple reduction summed per node
    first (nodes ordered by their master lane, summed by sum_units), expanded without multiple
    reduction lane by lane."""
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
        units = [sum_units([unit_of_rank(d) for d in ranks if d // per_node == g])
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
