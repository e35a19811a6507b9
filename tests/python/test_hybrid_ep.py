"""deep_ep.HybridEPBuffer (docs/hybrid-ep.md) against a dense reference written here in plain torch
from HybridEP's rules: every rank builds all ranks' inputs from seeds, and checks its own outputs
bit for bit (bit patterns, so -0 and +0 differ):

- dispatch: rows in ascending global id g = s*N + t, bytes of the source rows and scales, the probs
  of this NVLink domain's experts; the handle's D and local expert map;
- dispatch_with_permute: expert blocks at P_e = sum of pad(c_j), rows ascending g, zero padding
  rows (tokens, probs, scales), tokens_per_expert; with a too-small non-blocking budget the rows
  past it, the truncated counts and the overflow flag;
- combine / combine_with_unpermute: one FP32 accumulator from +0.0, the own domain's ranks
  ascending, then domains n-1, n-2, ... each as one BF16 unit (the FP32 sum of its ranks), one
  rounding; the permuted path first rounds each rank's sum over its experts; probabilities in FP32.

Ranks as threads (2 and 4 ranks on one node, 2 nodes of 2, 3 nodes of 2) and 2 processes over gloo."""

import pytest
import torch

import moe_ep
from moe_ep.deep_ep import HybridEPBuffer

from conftest import check_all_ok, run_processes

N, EL = 10, 2  # tokens per rank (not a multiple of 16 or 64), local experts


class Case:
    def __init__(self, ranks, nodes, fp8=False, pad=None, budget=False):
        self.G, self.M, self.L = ranks, nodes, ranks // nodes
        self.E, self.H = EL * ranks, 512 if fp8 else 128
        self.fp8, self.pad, self.budget = fp8, pad, budget

    def padded(self, c):
        return -(-c // self.pad) * self.pad if self.pad else c


def spread(gen, shape):
    """Values over many binades, so that the order of a sum changes its rounding."""
    return torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-30, 30, shape, generator=gen).float()


def inputs(case, rank):
    """x (BF16, or FP8 bytes and float32 scales), the routing map (0 to 6 experts a token) and
    probabilities (0 off-route) of one rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if case.fp8:
        x = torch.randint(0, 256, (N, case.H), dtype=torch.uint8, generator=gen)
        sf = torch.rand(N, case.H // 128, generator=gen)
    else:
        x, sf = spread(gen, (N, case.H)).to(torch.bfloat16), None
    count = torch.randint(0, 7, (N,), generator=gen)
    place = torch.rand(N, case.E, generator=gen).argsort(1).argsort(1)
    routing_map = place < count[:, None]
    probs = torch.where(routing_map, torch.rand(N, case.E, generator=gen) + 0.01, torch.zeros(N, case.E))
    return x, sf, routing_map, probs


def everything(case):
    parts = [inputs(case, r) for r in range(case.G)]
    return (torch.cat([p[0] for p in parts]), None if not case.fp8 else torch.cat([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]))


def expert_row(d, e, g, hidden):
    """Rank d's BF16 output for token g (e = -1: the compact row; else its local expert e)."""
    gen = torch.Generator().manual_seed((d * 64 + e + 1) * 100003 + g)
    return spread(gen, (hidden,)).to(torch.bfloat16)


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b):
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def received(case, d, routing_map):
    """The global ids rank d receives, ascending."""
    return routing_map[:, d * EL:(d + 1) * EL].any(1).nonzero().flatten().tolist()


def layout(case, d, routing_map):
    """Rank d's permuted layout: per local expert its global ids (ascending) and block start."""
    blocks, start = [], 0
    for e in range(EL):
        ids = routing_map[:, d * EL + e].nonzero().flatten().tolist()
        blocks.append((ids, start))
        start += case.padded(len(ids))
    return blocks, start


def budget_of(case, total):
    """The non-blocking budget of a rank: about half its rows, a multiple of the pad."""
    p = case.pad or 1
    return p * (total // p // 2)


def rank_unit(case, d, g, routing_map, permuted, kept):
    """FP32 values of rank d's BF16 contribution to token g (None: d does not receive g)."""
    if not routing_map[g, d * EL:(d + 1) * EL].any():
        return None
    if not permuted:
        return expert_row(d, -1, g, case.H).float()
    acc = torch.zeros(case.H)
    for e in range(EL):
        if routing_map[g, d * EL + e] and kept(d, e, g):
            acc = acc + expert_row(d, e, g, case.H).float()
    return acc.to(torch.bfloat16).float()


def reference_sum(case, g, unit_of, own_node_rounded=False, step=-1):
    """HybridEP's order for token g: the own node's ranks ascending, then nodes n-1, n-2, ...
    each one BF16 unit. Other orders, to show the cases tell them apart: own_node_rounded (the
    own node one BF16 unit too), step=1 (nodes n+1, n+2, ...)."""
    s = g // N
    acc = torch.zeros(case.H)
    for i in range(case.M):
        node = (s // case.L + step * i) % case.M
        node_acc, any_rank = torch.zeros(case.H), False
        for j in range(case.L):
            u = unit_of(node * case.L + j)
            if u is not None:
                node_acc, any_rank = node_acc + u, True
        if any_rank:
            acc = acc + (node_acc if i == 0 and not own_node_rounded else node_acc.to(torch.bfloat16).float())
    return acc.to(torch.bfloat16)


def prob_factor(d):
    return 1.0 + 0.375 * d


def check_dispatch(case, me, everything_, out, bad):
    x_all, sf_all, map_all, probs_all = everything_
    tokens, probs, sf, handle = out
    rows = received(case, me, map_all)
    width, base = EL * case.L, (me // case.L) * EL * case.L
    if not same(tokens, x_all[rows]):
        bad.append("dispatch: tokens")
    if not same(probs, probs_all[rows, base:base + width].contiguous()):
        bad.append("dispatch: probs (this domain's slice)")
    if case.fp8 and not same(sf, sf_all[rows]):
        bad.append("dispatch: scaling factors")
    if len(handle) != 7 or handle[3].tolist() != [len(rows)] or handle[5] != N:
        bad.append("dispatch: handle items")
    if not torch.equal(handle[4][:len(rows)], map_all[rows, me * EL:(me + 1) * EL]):
        bad.append("dispatch: local_expert_routing_map")
    return rows


def check_cached_dispatch(case, me, buf, everything_, handle, rows, bad):
    """dispatch with the handle: other rows (and probs) over the same routing."""
    other = [inputs(case, r + 100) for r in range(case.G)]
    width, base = EL * case.L, (me // case.L) * EL * case.L
    probs2 = torch.cat([o[3] for o in other])
    map_all = everything_[2]
    probs2 = torch.where(map_all, probs2 + 1.0, torch.zeros_like(probs2))  # on the handle's routes
    tokens, probs, sf, again = buf.dispatch(hidden=other[me][0], scaling_factor=other[me][1],
                                            probs=probs2[me * N:(me + 1) * N], handle=handle)
    if again is not handle or not same(tokens, torch.cat([o[0] for o in other])[rows]):
        bad.append("dispatch with a handle: tokens")
    if not same(probs, probs2[rows, base:base + width].contiguous()):
        bad.append("dispatch with a handle: probs")
    if case.fp8 and not same(sf, torch.cat([o[1] for o in other])[rows]):
        bad.append("dispatch with a handle: scaling factors")


def check_combine(case, me, buf, everything_, out, rows, bad):
    _, _, map_all, probs_all = everything_
    tokens, probs, _, handle = out
    y = torch.stack([expert_row(me, -1, g, case.H) for g in rows]) if rows else torch.zeros(0, case.H).bfloat16()
    returned = probs * prob_factor(me)
    combined, combined_probs = buf.combine(y, returned, handle)
    width = EL * case.L
    for t in range(N):
        g = me * N + t
        want = reference_sum(case, g, lambda d: rank_unit(case, d, g, map_all, False, None))
        if not same(combined[t], want):
            bad.append(f"combine: token {t}")
        want_p = torch.zeros(case.E)
        for d in range(case.G):  # each column is one node's: its ranks ascending
            if map_all[g, d * EL:(d + 1) * EL].any():
                node = d // case.L
                cols = slice(node * width, (node + 1) * width)
                want_p[cols] = want_p[cols] + probs_all[g, cols] * prob_factor(d)
        if not same(combined_probs[t], want_p):
            bad.append(f"combine: probs of token {t}")
    # HybridEP's test: each rank keeps only its own experts' columns; the probs come back exact.
    own = torch.zeros_like(probs)
    local = (me % case.L) * EL
    own[:, local:local + EL] = probs[:, local:local + EL]
    _, back = buf.combine(y, own, handle)
    if not same(back, probs_all[me * N:(me + 1) * N]):
        bad.append("combine: probs of own columns")


def permuted_reference(case, d, everything_, x_all, sf_all, rows_out, drop):
    """Rank d's permuted tokens, probs and scales, fitted to rows_out rows (rows >= drop empty)."""
    _, _, map_all, probs_all = everything_
    tokens = torch.zeros((rows_out, x_all.shape[1]), dtype=x_all.dtype)
    probs = torch.zeros(rows_out)
    sf = torch.zeros(rows_out, case.H // 128) if case.fp8 else None
    blocks, _ = layout(case, d, map_all)
    for e, (ids, start) in enumerate(blocks):
        for i, g in enumerate(ids):
            r = start + i
            if r < min(rows_out, drop):
                tokens[r], probs[r] = x_all[g], probs_all[g, d * EL + e]
                if case.fp8:
                    sf[r] = sf_all[g]
    return tokens, probs, sf


def check_permute(case, me, buf, everything_, bad):
    x_all, sf_all, map_all, probs_all = everything_
    x, sf, routing_map, probs = [t if t is None else t[me * N:(me + 1) * N] for t in everything_]
    blocks, total = layout(case, me, map_all)
    budget = budget_of(case, total) if case.budget else None
    out = buf.dispatch_with_permute(hidden=x, routing_map=routing_map, probs=probs, scaling_factor=sf,
                                    num_of_experts_per_rank=EL, pad_multiple=case.pad, num_permuted_tokens=budget,
                                    non_blocking=case.budget)
    tokens, pprobs, psf, tokens_per_expert, handle = out
    rows_out = total if budget is None else budget
    want = permuted_reference(case, me, everything_, x_all, sf_all, rows_out, rows_out)
    if not (same(tokens, want[0]) and same(pprobs, want[1]) and (not case.fp8 or same(psf, want[2]))):
        bad.append("dispatch_with_permute: tokens, probs or scales")
    counts = [min(len(ids), max(0, rows_out - start)) for ids, start in blocks]
    if tokens_per_expert.dtype != torch.int64 or tokens_per_expert.tolist() != [case.padded(c) for c in counts]:
        bad.append(f"dispatch_with_permute: tokens_per_expert {tokens_per_expert.tolist()}")
    last_ids, last_start = blocks[-1]
    overflow = int(case.budget and last_start + len(last_ids) > rows_out)
    if len(handle) != 11 or handle[7].tolist() != counts or handle[-1].tolist() != [overflow]:
        bad.append(f"dispatch_with_permute: handle counts {handle[7].tolist()} / overflow {handle[-1].tolist()}")
    # Cached (Megatron's backward of combine): other rows over the same handle.
    other = [inputs(case, r + 100) for r in range(case.G)]
    x2_all = torch.cat([o[0] for o in other])
    sf2_all = torch.cat([o[1] for o in other]) if case.fp8 else None
    again = buf.dispatch_with_permute(hidden=other[me][0], scaling_factor=other[me][1], handle=handle,
                                      num_permuted_tokens=torch.tensor(rows_out), pad_multiple=case.pad)
    want2 = permuted_reference(case, me, everything_, x2_all, sf2_all, rows_out, rows_out)
    if not same(again[0], want2[0]) or (case.fp8 and not same(again[2], want2[2])) or again[3] is not None:
        bad.append("dispatch_with_permute with a handle: tokens or scales")
    return handle


def check_unpermute(case, me, buf, everything_, handle, bad):
    _, _, map_all, probs_all = everything_
    budgets = {}
    for d in range(case.G):
        total = layout(case, d, map_all)[1]
        budgets[d] = budget_of(case, total) if case.budget else total

    def kept(d, e, g):
        blocks, _ = layout(case, d, map_all)
        ids, start = blocks[e]
        return start + ids.index(g) < budgets[d]

    rows_out = budgets[me]
    y = torch.zeros(rows_out, case.H, dtype=torch.bfloat16)
    p = torch.zeros(rows_out)
    for e, (ids, start) in enumerate(layout(case, me, map_all)[0]):
        for i, g in enumerate(ids):
            if start + i < rows_out:
                y[start + i] = expert_row(me, e, g, case.H)
                p[start + i] = probs_all[g, me * EL + e] * prob_factor(me)
    combined, combined_probs = buf.combine_with_unpermute(hidden=y, probs=p, handle=handle, pad_multiple=case.pad)
    for t in range(N):
        g = me * N + t
        want = reference_sum(case, g, lambda d: rank_unit(case, d, g, map_all, True, kept))
        if not same(combined[t], want):
            bad.append(f"combine_with_unpermute: token {t}")
        want_p = torch.zeros(case.E)
        for e in map_all[g].nonzero().flatten().tolist():
            if kept(e // EL, e % EL, g):
                want_p[e] = probs_all[g, e] * prob_factor(e // EL)
        if not same(combined_probs[t], want_p):
            bad.append(f"combine_with_unpermute: probs of token {t}")


def run_case(rank, case, group):
    everything_ = everything(case)
    x, sf, routing_map, probs = [t if t is None else t[rank * N:(rank + 1) * N] for t in everything_]
    buf = HybridEPBuffer(group=group, hidden_dim=case.H, max_num_of_tokens_per_rank=N, num_local_experts=EL,
                         use_fp8=case.fp8)
    bad = []
    if buf.num_of_nodes != case.M or buf.num_of_hybrid_ep_ranks_per_nvlink_domain != case.L:
        bad.append(f"domains: {buf.num_of_nodes} x {buf.num_of_hybrid_ep_ranks_per_nvlink_domain}")
    if not case.budget:
        out = buf.dispatch(hidden=x, scaling_factor=sf, routing_map=routing_map, probs=probs)
        rows = check_dispatch(case, rank, everything_, out, bad)
        check_cached_dispatch(case, rank, buf, everything_, out[3], rows, bad)
        check_combine(case, rank, buf, everything_, out, rows, bad)
    handle = check_permute(case, rank, buf, everything_, bad)
    check_unpermute(case, rank, buf, everything_, handle, bad)
    return bad


CASES = {
    "2 ranks": Case(2, 1), "4 ranks": Case(4, 1), "2x2": Case(4, 2), "2x2 pad 16": Case(4, 2, pad=16),
    "4 ranks fp8": Case(4, 1, fp8=True), "2x2 fp8 pad 16": Case(4, 2, fp8=True, pad=16),
    "3x2": Case(6, 3), "2x2 budget": Case(4, 2, budget=True), "3x2 pad 16 budget": Case(6, 3, pad=16, budget=True), "4 ranks budget pad 16": Case(4, 1, pad=16, budget=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_ep_threads(name):
    case = CASES[name]
    results = moe_ep.LocalWorld(case.G, case.M).run(lambda g: run_case(g.rank(), case, g))
    assert results == [[]] * case.G, results


def gloo_case(rank, world, group):
    return run_case(rank, Case(2, 1, pad=16), group)


def test_hybrid_ep_processes():
    assert check_all_ok(run_processes(gloo_case, 2)) == [[], []]


@pytest.mark.parametrize("name,other", [("2x2", dict(own_node_rounded=True)), ("3x2", dict(own_node_rounded=True)),
                                        ("3x2", dict(step=1))])
def test_reference_tells_the_orders_apart(name, other):
    """The cases are sensitive to rounding the own node's part first and to the order of the
    other nodes: the checks above can fail."""
    case = CASES[name]
    map_all = everything(case)[2]
    differ = 0
    for g in range(case.G * N):
        def unit_of(d):
            return rank_unit(case, d, g, map_all, False, None)
        differ += not same(reference_sum(case, g, unit_of), reference_sum(case, g, unit_of, **other))
    assert differ > 0


def test_bf16_plus_zero_only_changes_negative_zero():
    """The normalisation combine applies: every BF16 value + 0.0 is itself, except -0 -> +0 (and
    NaN stays NaN)."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    out = every + 0.0
    nan = torch.isnan(every)
    assert torch.isnan(out[nan]).all()
    neg_zero = bits(every) == -32768
    assert torch.equal(bits(out)[~nan & ~neg_zero], bits(every)[~nan & ~neg_zero])
    assert bits(out)[neg_zero].tolist() == [0]


def negative_zero_case(g):
    rank = g.rank()
    case = Case(4, 2)
    x, _, routing_map, probs = inputs(case, rank)
    routing_map[0] = True  # token 0 goes everywhere
    buf = HybridEPBuffer(g, case.H, N, EL)
    tokens, p, _, handle = buf.dispatch(hidden=x, routing_map=routing_map, probs=probs)
    combined, _ = buf.combine(torch.full_like(tokens, -0.0), p, handle)
    permuted, pp, _, _, h2 = buf.dispatch_with_permute(hidden=x, routing_map=routing_map, probs=probs)
    combined2, _ = buf.combine_with_unpermute(hidden=torch.full_like(permuted, -0.0), probs=pp, handle=h2)
    return bits(combined).unique().tolist(), bits(combined2).unique().tolist()


def test_all_negative_zero_inputs_combine_to_positive_zero():
    """HybridEP's accumulator starts at +0.0, so a sum of -0 rows is +0."""
    assert moe_ep.LocalWorld(4, 2).run(negative_zero_case) == [([0], [0])] * 4


def growth_case(g):
    """A call with more tokens than the buffer was built for grows it; handles made before still work."""
    buf = HybridEPBuffer(g, 128, 16, EL)
    results = []
    handles = []
    for n in (5, 600):
        gen = torch.Generator().manual_seed(7 + g.rank())
        x = spread(gen, (n, 128)).to(torch.bfloat16)
        routing_map = torch.zeros(n, EL * g.size(), dtype=torch.bool)
        routing_map[:, -1] = True  # every token to the last rank
        tokens, _, _, handle = buf.dispatch(hidden=x, routing_map=routing_map)
        handles.append((x, tokens, handle))
    for x, tokens, handle in handles:
        combined, _ = buf.combine(tokens, None, handle)
        results.append(same(combined, x))
    return results


def test_buffer_grows_for_more_tokens():
    assert moe_ep.LocalWorld(2).run(growth_case) == [[True, True]] * 2
