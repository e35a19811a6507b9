"""Megatron-Core's own MoE token dispatcher on moe-ep: the flex dispatcher
(megatron.core.transformer.moe.token_dispatcher.MoEFlexTokenDispatcher, its fused dispatch and
combine in megatron/core/transformer/moe/fused_a2a.py) with both of its backends, DeepEP
(``deep_ep.Buffer``) and HybridEP (``_HybridEPManager`` on ``deep_ep.HybridEPBuffer``), unmodified,
forward and backward, on 2 and 4 CPU processes over gloo, with ``deep_ep`` resolving to moe-ep
through the alias directory (build tree) or the wheel's switch (installed). With HybridEP every rank has the same token count (it all-gathers
equal-sized routing maps).

Each process runs Megatron's dispatch_preprocess -> token_dispatch -> dispatch_postprocess, a
linear expert per local expert (y = (x @ W_e) * prob), combine_preprocess -> token_combine ->
combine_postprocess, and backward of sum(out * G). The test compares the outputs, the tokens per
expert and the gradients of x, the router probabilities and the expert weights with the same
layer written densely in plain torch (float64) in this process: tokens per expert exactly, the
rest within the BF16 roundings of the path (each bound is the number of roundings times 2^-9 of
the sum of the magnitudes of its terms, so a missing or doubled term is always caught).

The HybridEP cases install the CPU compatibility layer (MOE_EP_CPU_COMPAT=1): Megatron-Core 0.19's
HybridEP manager allocates a device="cuda" tensor. Megatron's dispatch_preprocess is torch.compile'd; it runs eagerly here (TORCH_COMPILE_DISABLE=1):
compiling it on the CPU takes most of a minute and is Megatron's code, not DeepEP's path."""

import pytest
import torch

from conftest import check_all_ok, run_processes

E, K, H = 8, 2, 128


def tokens_of(rank, backend):
    return 7 if backend == "hybridep" else 5 + 2 * rank


def rank_inputs(rank, backend):
    """x (BF16 values), the routing map and the masked router probabilities, and the loss weights."""
    g = torch.Generator().manual_seed(1000 + rank)
    n = tokens_of(rank, backend)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(n, E, generator=g), dim=-1)
    top = probs.topk(K, dim=-1)
    routing_map = torch.zeros(n, E, dtype=torch.bool).scatter(1, top.indices, True)
    masked = torch.zeros(n, E).scatter(1, top.indices, top.values)
    G = torch.randn(n, H, generator=g)
    return x, routing_map, masked, G


def expert_weight(e):
    g = torch.Generator().manual_seed(77 + e)
    return torch.randn(H, H, generator=g) / H ** 0.5


def megatron_layer(rank, world, group, backend):
    import deep_ep
    import moe_ep
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import fused_a2a
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    import torch.distributed as dist

    if backend == "hybridep":
        assert deep_ep.HybridEPBuffer is moe_ep.deep_ep.HybridEPBuffer and fused_a2a.HAVE_HYBRIDEP
    else:
        assert deep_ep.Buffer is moe_ep.deep_ep.Buffer and fused_a2a.HAVE_DEEP_EP
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E, moe_router_topk=K,
                            moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend,
                            moe_router_dtype="fp32", expert_model_parallel_size=world, params_dtype=torch.bfloat16,
                            bf16=True, use_cpu_initialization=True)
    pgs = ProcessGroupCollection()
    singles = [dist.new_group([r]) for r in range(world)]
    pgs.ep, pgs.tp_ep, pgs.expt_tp, pgs.tp = group, group, singles[rank], singles[rank]
    El = E // world
    dispatcher = MoEFlexTokenDispatcher(El, list(range(rank * El, (rank + 1) * El)), cfg, pg_collection=pgs)

    x, routing_map, masked, G = rank_inputs(rank, backend)
    x = x.clone().requires_grad_()
    probs = masked.clone().requires_grad_()
    weights = [expert_weight(rank * El + i).requires_grad_() for i in range(El)]
    results = []
    for step in range(2):  # the buffer and the handle are reused across steps
        for t in [x, probs] + weights:
            t.grad = None
        hidden, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
        hidden, p = dispatcher.token_dispatch(hidden, p)
        hidden, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(hidden, p)
        assert permuted_probs.dtype == torch.float32
        outputs, start = [], 0
        for i, count in enumerate(tokens_per_expert.tolist()):
            rows = hidden[start:start + count]
            outputs.append(((rows.float() @ weights[i]) * permuted_probs[start:start + count, None]).to(torch.bfloat16))
            start += count
        assert start == hidden.shape[0]
        expert_out = torch.cat(outputs) if outputs else hidden[:0]
        out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(expert_out)))
        (out.float() * G).sum().backward()
        results.append(dict(out=out.float().tolist(), tokens_per_expert=tokens_per_expert.tolist(),
                            grad_x=x.grad.float().tolist(), grad_probs=probs.grad.tolist(),
                            grad_w=[w.grad.tolist() for w in weights]))
    return results


def dense_reference(world, backend):
    """The layer over all ranks' tokens in float64: outputs, tokens per expert, gradients, and the
    magnitude sums that bound each element's rounding."""
    El = E // world
    W = [expert_weight(e).double().requires_grad_() for e in range(E)]
    per_rank = []
    counts = [[0] * El for _ in range(world)]
    loss = 0
    for r in range(world):
        x, routing_map, masked, G = rank_inputs(r, backend)
        x = x.double().requires_grad_()
        p = masked.double().requires_grad_()
        m = routing_map.double()
        out = sum(m[:, e:e + 1] * p[:, e:e + 1] * (x @ W[e]) for e in range(E))
        loss = loss + (out * G.double()).sum()
        absx, absG = x.detach().abs(), G.double().abs()
        bound_out = sum(m[:, e:e + 1] * p.detach()[:, e:e + 1] * (absx @ W[e].detach().abs()) for e in range(E))
        bound_gx = sum(m[:, e:e + 1] * p.detach()[:, e:e + 1] * (absG @ W[e].detach().abs().T) for e in range(E))
        bound_gp = torch.stack([(absG * (absx @ W[e].detach().abs())).sum(1) for e in range(E)], 1) * m
        per_rank.append(dict(x=x, p=p, out=out, m=m, G=G.double(), bound_out=bound_out, bound_gx=bound_gx,
                             bound_gp=bound_gp))
        for t in range(x.shape[0]):
            for e in routing_map[t].nonzero().flatten().tolist():
                counts[e // El][e % El] += 1
    loss.backward()
    bound_w = [sum(((rr["m"][:, e] * rr["p"].detach()[:, e])[:, None] * rr["x"].detach().abs()).T @ rr["G"].abs()
                   for rr in per_rank) for e in range(E)]
    return per_rank, counts, W, bound_w


def within(actual, expected, bound, scale, what):
    actual = torch.tensor(actual, dtype=torch.float64)
    err = (actual - expected.detach()).abs()
    limit = scale * bound + 1e-6
    worst = (err - limit).max().item()
    assert worst <= 0, f"{what}: off by {err.max().item():.3g} (limit exceeded by {worst:.3g})"


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_flex_dispatcher_forward_and_backward(world, backend):
    # HybridEP's manager keeps a device="cuda" flag tensor (Megatron-Core 0.19): the CPU compatibility
    # layer makes it a CPU tensor, as an engine's CI would.
    env = {"TORCH_COMPILE_DISABLE": "1"}
    if backend == "hybridep":
        env["MOE_EP_CPU_COMPAT"] = "1"
    results = check_all_ok(run_processes(megatron_layer, world, args=(backend,), env=env, timeout=600))
    per_rank, counts, W, bound_w = dense_reference(world, backend)
    El = E // world
    for r, steps in enumerate(results):
        ref = per_rank[r]
        for step, got in enumerate(steps):
            what = f"rank {r} step {step}"
            assert got["tokens_per_expert"] == counts[r], what
            # Three BF16 roundings (2^-9 each) on the way to the output, four to the grad of x.
            within(got["out"], ref["out"], ref["bound_out"], 2 ** -7, f"{what}: output")
            within(got["grad_x"], ref["x"].grad, ref["bound_gx"], 2 ** -6, f"{what}: grad of x")
            within(got["grad_probs"], ref["p"].grad * ref["m"], ref["bound_gp"], 2 ** -7, f"{what}: grad of probs")
            for i in range(El):
                e = r * El + i
                within(got["grad_w"][i], W[e].grad, bound_w[e], 2 ** -7, f"{what}: grad of expert {e}'s weight")
