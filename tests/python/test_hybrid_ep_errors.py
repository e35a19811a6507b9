"""deep_ep.HybridEPBuffer's signatures (the reference's parameter lists and defaults: Megatron
inspects dispatch_with_permute) and its refusals: a bad argument raises a typed error naming the
argument and the value on the rank that passed it, its peers raise PeerError naming that rank, and
nothing waits (ranks as threads; docs/hybrid-ep.md)."""

import inspect

import pytest
import torch

import moe_ep
from moe_ep.deep_ep import HybridEPBuffer, HybridEpConfigInstance

N, H, EL = 6, 128, 2
P = inspect.Parameter
REFERENCE = {
    "__init__": "self group hidden_dim max_num_of_tokens_per_rank num_local_experts use_fp8=False "
                "num_sms_dispatch_api=None num_sms_combine_api=None num_sms_preprocessing_api=None "
                "num_blocks_permute=None num_blocks_unpermute=None load_cached_kernels=False use_shared_buffer=True "
                "enable_custom_allgather=False num_of_hybrid_ep_ranks_per_nvlink_domain=None use_mnnvl=None",
    "update_template_config": "self hidden_dim=None num_of_tokens_per_rank=None num_local_experts=None "
                              "pad_multiple=None use_fp8=None fuse_permute_dispatch=False **kwargs",
    "dispatch": "self hidden scaling_factor=None topk_idx=None topk_weights=None num_of_experts=None probs=None "
                "routing_map=None num_dispatched_tokens_tensor=None num_dispatched_tokens=None handle=None",
    "combine": "self hidden probs=None handle=None",
    "dispatch_with_permute": "self * hidden topk_idx=None topk_weights=None num_of_experts_per_rank=None "
                             "num_of_experts=None use_fp8=None routing_map=None probs=None scaling_factor=None "
                             "num_permuted_tokens=None pad_multiple=None handle=None non_blocking=False "
                             "fuse_permute_dispatch=False num_dispatched_tokens=None use_host_meta=None",
    "combine_with_unpermute": "self * hidden probs=None handle=None pad_multiple=None fuse_unpermute_combine=False "
                              "num_dispatched_tokens=None",
}


def described(fn):
    """The signature in REFERENCE's notation."""
    words, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind == P.KEYWORD_ONLY and not star:
            words.append("*")
            star = True
        if p.kind == P.VAR_KEYWORD:
            words.append("**" + p.name)
        elif p.default is P.empty:
            words.append(p.name)
        else:
            words.append(f"{p.name}={p.default!r}")
    return " ".join(words)


@pytest.mark.parametrize("method", list(REFERENCE))
def test_signatures_are_the_references(method):
    assert described(getattr(HybridEPBuffer, method)) == REFERENCE[method]


def outcome(fn):
    """("ok", "") or the error's type name and message, and for a PeerError the ranks it names."""
    try:
        fn()
        return ("ok", "")
    except moe_ep.PeerError as e:
        return ("PeerError", str(e), list(e.ranks))
    except Exception as e:  # the test compares the type and message of each rank's error
        return (type(e).__name__, str(e))


def inputs(rank, experts, tokens=N):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    routing_map = torch.rand(tokens, experts, generator=g) > 0.5
    return x, routing_map, torch.where(routing_map, torch.rand(tokens, experts, generator=g), torch.zeros(tokens, experts))


def run(ranks, nodes, fn):
    return moe_ep.LocalWorld(ranks, nodes).run(lambda g: fn(g, g.rank()))


def expect(results, bad_rank, kind, *words):
    """bad_rank raised `kind` naming the words (and its rank); every other rank PeerError naming it."""
    for r, (name, message, *ranks) in enumerate(results):
        if r == bad_rank:
            assert name == kind, results
            assert message.startswith(f"[rank {r}] HybridEPBuffer"), message
            for w in words:
                assert w in message, (w, message)
        else:
            assert name == "PeerError" and ranks == [[bad_rank]], results[r]


def test_invalid_config_raises_on_every_rank():
    results = run(2, 1, lambda g, r: outcome(lambda: HybridEPBuffer(g, 100, N, EL)))
    for name, message, *_ in results:
        assert name == "InvalidArgument" and "hidden_dim = 100 is not a multiple of 16" in message, results
    # One rank's bad value: that rank names it, the other names the rank.
    results = run(2, 1, lambda g, r: outcome(lambda: HybridEPBuffer(g, H, N, 1 if r == 1 else EL)))
    expect(results, 1, "InvalidArgument", "The buffer config is not valid", "1 * 2", "multiple of 4")
    results = run(4, 2, lambda g, r: outcome(lambda: HybridEPBuffer(g, H, 30000, EL)))
    assert all(o[0] == "InvalidArgument" and "3 * T + 1 = 90049" in o[1] for o in results), results


def test_nvlink_domain_override_must_match_the_nodes(monkeypatch):
    monkeypatch.setenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "4")
    results = run(4, 2, lambda g, r: outcome(lambda: HybridEPBuffer(g, H, N, EL)))
    for name, message, *_ in results:
        assert name == "InvalidArgument", results
        assert "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN = 4" in message and "the 2 ranks per node" in message
    monkeypatch.setenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "2")
    assert run(4, 2, lambda g, r: HybridEPBuffer(g, H, N, EL).num_of_nodes) == [2] * 4


def dispatch_case(bad_rank, op, change):
    """Every rank dispatches; bad_rank's call is changed by change(kwargs)."""
    def fn(g, r):
        buf = HybridEPBuffer(g, H, N, EL)
        x, routing_map, probs = inputs(r, EL * g.size())
        kwargs = dict(hidden=x, routing_map=routing_map, probs=probs)
        if r == bad_rank:
            change(kwargs)
        first = outcome(lambda: getattr(buf, op)(**kwargs))
        # Nothing is left half done: the group goes on.
        after = buf.dispatch(hidden=x, routing_map=routing_map, probs=probs)[0].shape[1]
        return first, after
    results = run(2, 1, fn)
    assert [a for _, a in results] == [H, H]
    return [f for f, _ in results]


def test_dispatch_arguments():
    e = EL * 2
    expect(dispatch_case(1, "dispatch", lambda k: k.update(hidden=k["hidden"].float())), 1, "InvalidArgument",
           "HybridEPBuffer.dispatch", "hidden has dtype torch.float32")
    expect(dispatch_case(0, "dispatch", lambda k: k.update(routing_map=torch.ones(N, e + 1, dtype=torch.bool))), 0,
           "InvalidArgument", "routing_map has shape [6, 5], expected [6, 4]")
    expect(dispatch_case(0, "dispatch", lambda k: k.update(routing_map=None, probs=None,
                                                           topk_idx=torch.zeros(N, 2, dtype=torch.int64),
                                                           num_of_experts=e + 2)), 0,
           "InvalidArgument", "num_of_experts = 6, expected 4")
    expect(dispatch_case(0, "dispatch", lambda k: k.update(hidden=[[0.0] * H] * N)), 0, "InvalidArgument",
           "hidden is a list, expected a torch tensor")
    expect(dispatch_case(1, "dispatch", lambda k: k.update(routing_map=None, probs=None)), 1, "InvalidArgument",
           "no routing input")
    expect(dispatch_case(1, "dispatch", lambda k: k.update(hidden=torch.zeros(N + 1, H, dtype=torch.bfloat16),
                                                           routing_map=torch.ones(N + 1, e, dtype=torch.bool),
                                                           probs=torch.ones(N + 1, e))), 1,
           "InvalidArgument", "hidden has 7 tokens (hidden rows) here and 6 on rank 0")
    expect(dispatch_case(0, "dispatch_with_permute", lambda k: k.update(non_blocking=True)), 0, "InvalidArgument",
           "non_blocking=True needs num_permuted_tokens")
    expect(dispatch_case(0, "dispatch_with_permute", lambda k: k.update(num_permuted_tokens=torch.tensor([3, 4]))), 0,
           "InvalidArgument", "num_permuted_tokens is a torch.int64 tensor of shape [2]")


def test_more_than_32_experts_a_token():
    def fn(g, r):
        buf = HybridEPBuffer(g, H, N, 18)
        routing_map = torch.zeros(N, 36, dtype=torch.bool)
        routing_map[:, :2] = True
        if r == 0:
            routing_map[3] = True
        x = torch.zeros(N, H, dtype=torch.bfloat16)
        return outcome(lambda: buf.dispatch(hidden=x, routing_map=routing_map))
    expect(run(2, 1, fn), 0, "InvalidArgument", "token 3 is routed to 36 experts", "at most 32")


def test_fp8_needs_scales():
    def fn(g, r):
        buf = HybridEPBuffer(g, 512, N, EL, use_fp8=True)
        x = torch.zeros(N, 512, dtype=torch.uint8)
        sf = None if r == 1 else torch.ones(N, 4)
        return outcome(lambda: buf.dispatch(hidden=x, scaling_factor=sf, routing_map=inputs(r, EL * 2)[1]))
    expect(run(2, 1, fn), 1, "InvalidArgument", "scaling_factor is None", "float32 [6, 4]")


def test_blocking_budget_too_small_raises_where_it_is():
    def fn(g, r):
        buf = HybridEPBuffer(g, H, N, EL)
        x, routing_map, probs = inputs(r, EL * 2)
        routing_map[:, :EL] = True  # rank 0 receives 2 * N pairs
        budget = 3 if r == 0 else None
        first = outcome(lambda: buf.dispatch_with_permute(hidden=x, routing_map=routing_map, probs=probs,
                                                          num_permuted_tokens=budget))
        again = buf.dispatch_with_permute(hidden=x, routing_map=routing_map, probs=probs)[3].tolist()
        return first, again
    (first0, again0), (first1, again1) = run(2, 1, fn)
    assert first0[0] == "InvalidArgument", first0
    assert "num_permuted_tokens = 3" in first0[1] and f"the {4 * N} rows" in first0[1], first0
    assert first1 == ("ok", "") and again0 == [2 * N, 2 * N]


def combine_case(bad_rank, op, change):
    def fn(g, r):
        buf = HybridEPBuffer(g, H, N, EL)
        x, routing_map, probs = inputs(r, EL * 2)
        if op == "combine":
            tokens, p, _, handle = buf.dispatch(hidden=x, routing_map=routing_map, probs=probs)
            kwargs = dict(hidden=tokens, probs=p, handle=handle)
        else:
            tokens, p, _, _, handle = buf.dispatch_with_permute(hidden=x, routing_map=routing_map, probs=probs)
            kwargs = dict(hidden=tokens, probs=p, handle=handle)
        if r == bad_rank:
            change(kwargs)
        return outcome(lambda: getattr(buf, op)(**kwargs))
    return run(2, 1, fn)


def test_combine_arguments():
    expect(combine_case(0, "combine", lambda k: k.update(handle=None)), 0, "InvalidArgument",
           "handle is None; combine needs the 7-tuple dispatch returned")
    expect(combine_case(1, "combine", lambda k: k.update(hidden=k["hidden"].view(torch.uint8))), 1,
           "InvalidArgument", "hidden has dtype torch.uint8")
    expect(combine_case(0, "combine", lambda k: k.update(probs="not a tensor")), 0, "InvalidArgument",
           "probs is a str, expected a torch tensor")
    expect(combine_case(1, "combine_with_unpermute", lambda k: k.update(hidden=k["hidden"][:1])), 1,
           "InvalidArgument", "hidden has shape [1, 128]", "at least")
    expect(combine_case(0, "combine_with_unpermute", lambda k: k.update(pad_multiple=16)), 0, "InvalidArgument",
           "pad_multiple = 16 differs")


def test_tensors_torch_does_not_export():
    expect(dispatch_case(0, "dispatch", lambda k: k.update(hidden=k["hidden"].to("meta"))), 0, "InvalidArgument",
           "hidden is on meta")
    expect(dispatch_case(1, "dispatch", lambda k: k.update(hidden=k["hidden"].to_sparse())), 1, "InvalidArgument",
           "hidden has layout torch.sparse_coo", "dense tensors (layout torch.strided)")
    expect(dispatch_case(0, "dispatch", lambda k: k.update(routing_map=k["routing_map"].to_sparse())), 0,
           "InvalidArgument", "routing_map has layout torch.sparse_coo")
    expect(combine_case(1, "combine", lambda k: k.update(hidden=k["hidden"].to_sparse_csr())), 1, "InvalidArgument",
           "hidden has layout torch.sparse_csr")


def test_integers_out_of_range():
    results = run(2, 1, lambda g, r: outcome(lambda: HybridEPBuffer(g, 2 ** 64 if r == 1 else H, N, EL)))
    expect(results, 1, "InvalidArgument", "hidden_dim = 18446744073709551616 is out of range (must be at most "
           "2147483647)")
    # 2**31 - 1 tokens fit an int, their capacity T (rounded up to 64) does not.
    results = run(2, 1, lambda g, r: outcome(lambda: HybridEPBuffer(g, H, 2 ** 31 - 1 if r == 1 else N, EL)))
    expect(results, 1, "InvalidArgument", "T = 2147483648 tokens per rank", "must be at most 2147483647")


def test_cached_permute_needs_num_permuted_tokens():
    def fn(g, r):
        buf = HybridEPBuffer(g, H, N, EL)
        x, routing_map, probs = inputs(r, EL * 2)
        _, _, _, tpe, handle = buf.dispatch_with_permute(hidden=x, routing_map=routing_map, probs=probs)
        n = None if r == 0 else tpe.sum()
        return outcome(lambda: buf.dispatch_with_permute(hidden=x, handle=handle, num_permuted_tokens=n))
    expect(run(2, 1, fn), 0, "TypeError", "num_permuted_tokens is required with a handle")


def test_config_knobs():
    config = HybridEpConfigInstance(hidden_dim=128, num_of_experts_per_rank=2, num_of_ranks_per_node=2)
    assert config.is_valid() and config.pad_multiple == 1
    with pytest.raises(moe_ep.InvalidArgument, match="no field 'not_a_knob'"):
        config.update({"not_a_knob": 1})

    def fn(g, r):
        buf = HybridEPBuffer(g, H, N, EL, num_sms_dispatch_api=4)
        made = buf.update_template_config(hidden_dim=256, pad_multiple=16, num_of_blocks_combine_api=3)
        with pytest.raises(moe_ep.InvalidArgument, match="hidden_dim = 100"):
            buf.update_template_config(hidden_dim=100)
        return (made.hidden_dim, made.pad_multiple, made.num_of_blocks_dispatch_api, made.num_of_blocks_combine_api,
                buf.local_rank, buf.node_rank, buf.group_size)
    assert run(4, 2, fn) == [(256, 16, 4, 3, r % 2, r // 2, 4) for r in range(4)]
