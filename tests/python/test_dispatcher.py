"""moe_ep.TokenDispatcher (docs/dispatcher.md): V1 by default, V2 with use_v2=True or
MOE_EP_USE_V2=1; normal, low_latency and auto modes with their output formats checked against the
reference; the a/b split and hooks; BufferCache reuse; the provider probe with real provider
libraries (built by tests/CMakeLists.txt)."""

import os
import subprocess
import sys

import pytest
import torch

import moe_ep

import reference as ref
from conftest import ALIAS_DIR, PYTHON_DIR, provider_library
from scenarios import assert_same

H, E, K, CAP, PREFILL = 256, 16, 4, 16, 64


def make_dispatcher(g, **kw):
    cache = moe_ep.BufferCache(g)
    kw.setdefault("num_max_dispatch_tokens_per_rank", CAP)
    kw.setdefault("num_max_prefill_tokens_per_rank", PREFILL)
    return cache, moe_ep.TokenDispatcher(cache, H, E, K, **kw)


def check_round(g, d, kind, seed, expect_format, alignment=1, micro_batch=0, split=False):
    """One dispatch + combine, every output checked; returns the format."""
    R, rank = g.size(), g.rank()
    inputs = ref.make_inputs(R, 12, H, E, K, seed)
    x, idx, w = inputs[rank]
    if split:
        d.dispatch_a(x, idx, w, kind=kind, micro_batch=micro_batch)
        out = d.dispatch_b(micro_batch)
    else:
        out = d.dispatch(x, idx, w, kind=kind, micro_batch=micro_batch)
    assert out.format == expect_format, (out.format, expect_format)
    assert out["format"] == out.format and out.micro_batch == micro_batch
    v2 = d.generation == "V2"
    ranks_per_node = g.num_scaleup if g.num_scaleout > 1 else None
    if out.format == "normal":
        y, want = check_normal(out, inputs, rank, alignment, ranks_per_node)
    elif out.format == "v2_expanded":
        y, want = check_v2_expanded(out, inputs, rank, alignment, ranks_per_node if v2 else None)
    else:
        assert out.format == "low_latency"
        y, want = check_low_latency(out, inputs, rank, v2, ranks_per_node if v2 else None)
    if split:
        d.combine_a(y, micro_batch)
        got = d.combine_b(micro_batch)
    else:
        got = d.combine(y, micro_batch)
    assert_same(got, want, f"combined ({out.format}, {d.generation})")
    return out.format


# Each format's check of what the experts got returns what they give back (y) and the combine's
# expected result.

def check_normal(out, inputs, rank, alignment, ranks_per_node):
    x = inputs[rank][0]
    exp = ref.v1_dispatch(inputs, rank, E, alignment)
    assert_same(out.hidden_states, exp["recv_x"], "hidden_states")
    assert_same(out.topk_ids, exp["recv_topk_idx"], "topk_ids")
    assert_same(out.topk_weights, exp["recv_topk_weights"], "topk_weights (0 where the id is -1)")
    assert list(out.num_recv_tokens_per_expert) == exp["num_recv_tokens_per_expert_list"]
    y = ref.rank_transform(out.hidden_states, rank)
    want = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda dd, t: ref.rank_transform(x[t], dd),
                            ranks_per_node=ranks_per_node)
    return y, want


def check_v2_expanded(out, inputs, rank, alignment, ranks_per_node):
    El = E // len(inputs)
    exp = ref.v2_dispatch_expanded(inputs, rank, E, alignment)
    assert list(out.num_recv_tokens_per_expert) == [ref.align(c, alignment) for c in exp["counts"]]
    assert out.masked_m.tolist() == exp["counts"]
    y = torch.full((out.hidden_states.shape[0], H), 1e4, dtype=torch.bfloat16)
    for i in range(El):
        st = exp["starts"][i]
        for r, (s, t, j) in enumerate(exp["per_expert"][i]):
            assert_same(out.hidden_states[st + r], inputs[s][0][t], f"expanded row {st + r}")
            assert float(out.topk_weights[st + r]) == float(inputs[s][2][t, j])
            y[st + r] = ref.bf16(out.topk_weights[st + r] * ref.expert_transform(out.hidden_states[st + r],
                                                                                 rank * El + i).float())
    return y, weighted_lanes_combined(inputs, rank, ranks_per_node)


def check_low_latency(out, inputs, rank, v2, ranks_per_node):
    R, x = len(inputs), inputs[rank][0]
    El = E // R
    per = ref.ll_expert_tokens(inputs, rank, E)
    assert out.hidden_states.shape == (El, R * CAP, H)
    assert out.masked_m.dtype == torch.int32 and out.masked_m.tolist() == [len(p) for p in per]
    assert out.expected_m == (x.shape[0] * R * K + E) // E
    y = torch.zeros(El, R * CAP, H, dtype=torch.bfloat16)
    for i, p in enumerate(per):
        if p:
            assert_same(out.hidden_states[i, :len(p)], torch.stack([inputs[s][0][t] for s, t in p]),
                        f"slab of local expert {i} (source rank, then token order)")
            y[i, :len(p)] = ref.expert_transform(out.hidden_states[i, :len(p)], rank * El + i)
    if v2:
        return y, weighted_lanes_combined(inputs, rank, ranks_per_node)
    return y, ref.ll_combine(inputs, rank, E, lambda t, e: ref.expert_transform(x[t], e))


def weighted_lanes_combined(inputs, rank, ranks_per_node):
    """The V2 combine of lanes that each returned bf16(w * f_e(x))."""
    x, idx, w = inputs[rank]
    return ref.combine_rank(inputs, rank, E, lane_rows_of=lambda t, j: ref.bf16(
        w[t, j] * ref.expert_transform(x[t], int(idx[t, j])).float()), ranks_per_node=ranks_per_node)


TOPOLOGIES = [pytest.param(2, 1, id="2x1"), pytest.param(4, 2, id="2x2")]


@pytest.mark.parametrize("n,so", TOPOLOGIES)
@pytest.mark.parametrize("use_v2", [None, True], ids=["default_v1", "v2"])
def test_modes(n, so, use_v2):
    def fn(g):
        results = []
        for mode, kind, fmt in (("normal", "prefill", "normal"), ("normal", "decode", "normal"),
                                ("low_latency", "prefill", "low_latency"), ("low_latency", "decode", "low_latency")):
            cache, d = make_dispatcher(g, use_v2=use_v2, mode=mode)
            assert d.generation == ("V2" if use_v2 else "V1")
            results.append(check_round(g, d, kind, seed=len(results), expect_format=fmt))
            del d
            cache.destroy()
        return results
    out = moe_ep.LocalWorld(n, so).run(fn)
    assert out[0] == ["normal", "normal", "low_latency", "low_latency"]


@pytest.mark.parametrize("n,so", TOPOLOGIES)
@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_auto_mode_and_buffer_reuse(n, so, use_v2):
    def fn(g):
        cache, d = make_dispatcher(g, use_v2=use_v2)
        assert d.mode == "auto" and d.resolve("prefill") == "normal" and d.resolve("extend") == "normal"
        assert d.resolve("decode") == "low_latency"
        fmts = [check_round(g, d, "prefill", 1, "normal"), check_round(g, d, "decode", 2, "low_latency"),
                check_round(g, d, "decode", 3, "low_latency"), check_round(g, d, "extend", 4, "normal"),
                check_round(g, d, "decode", 5, "low_latency")]
        s = cache.stats()
        assert s["builds"] == 1 and s["reuses"] == 4 and s["destroys"] == 0, s
        assert s["current_generation"] == ("V2" if use_v2 else "V1") and s["current_provider"] == "cpu"
        # V1: clean_low_latency_buffer on each normal -> low-latency transition only; V2: never
        assert s["clean_calls"] == (0 if use_v2 else 2), s
        # a second layer with the same shape shares the buffer; another hidden size rebuilds it
        d2 = moe_ep.TokenDispatcher(cache, H, E, K, use_v2=use_v2, num_max_dispatch_tokens_per_rank=CAP,
                                    num_max_prefill_tokens_per_rank=PREFILL)
        check_round(g, d2, "prefill", 6, "normal")
        assert cache.stats()["builds"] == 1 and cache.stats()["reuses"] == 5
        d3 = moe_ep.TokenDispatcher(cache, 512, E, K, use_v2=use_v2, num_max_dispatch_tokens_per_rank=CAP,
                                    num_max_prefill_tokens_per_rank=PREFILL)
        x = torch.zeros(4, 512, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1, 2, 3]] * 4)
        out = d3.dispatch(x, idx, torch.ones(4, K), kind="prefill")
        d3.combine(torch.zeros_like(out.hidden_states))
        s = cache.stats()
        assert s["builds"] == 2 and s["destroys"] == 1, s
        return fmts
    out = moe_ep.LocalWorld(n, so).run(fn)
    assert out[0] == ["normal", "low_latency", "low_latency", "normal", "low_latency"]


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_v2_expanded_normal_layout_and_alignment(use_v2):
    def fn(g):
        cache, d = make_dispatcher(g, use_v2=use_v2, mode="normal", v2_expanded_normal_layout=True,
                                   expert_alignment=4)
        return check_round(g, d, "prefill", 7, "v2_expanded" if use_v2 else "normal", alignment=4)
    moe_ep.LocalWorld(4, 2).run(fn)


def test_hybrid_ep_layout_is_hybrid_ep_buffers():
    """v2_normal_layout="hybrid_ep" gives, bit for bit, what deep_ep.HybridEPBuffer's permuted dispatch
    and combine give on the same routing (each is checked against HybridEP's rules elsewhere:
    tests/dispatcher/dispatcher_hybrid_ep_test.cc, test_hybrid_ep.py); 2 nodes of 2 ranks."""
    from moe_ep.deep_ep import HybridEPBuffer

    def fn(g):
        n, pad = 8, 4  # HybridEP needs the same token count on every rank
        x, idx, w = (t[:n].contiguous() for t in ref.make_inputs(g.size(), 12, H, E, K, 31)[g.rank()])
        cache, d = make_dispatcher(g, use_v2=True, mode="normal", v2_normal_layout="hybrid_ep", expert_alignment=pad)
        out = d.dispatch(x, idx, w, kind="prefill")
        assert out.format == "hybrid_ep" and d.options()["v2_normal_layout"] == "hybrid_ep"
        y = (out.hidden_states.float() * (1 + out.topk_weights[:, None])).bfloat16()
        combined = d.combine(y)
        buf = HybridEPBuffer(g, hidden_dim=H, max_num_of_tokens_per_rank=n, num_local_experts=E // g.size())
        tokens, probs, _, per_expert, handle = buf.dispatch_with_permute(
            hidden=x, topk_idx=idx, topk_weights=w, num_of_experts=E, pad_multiple=pad)
        assert torch.equal(tokens.view(torch.int16), out.hidden_states.view(torch.int16))
        assert torch.equal(probs, out.topk_weights)
        assert per_expert.tolist() == out.num_recv_tokens_per_expert
        theirs, _ = buf.combine_with_unpermute(hidden=(tokens.float() * (1 + probs[:, None])).bfloat16(),
                                               handle=handle, pad_multiple=pad)
        assert torch.equal(theirs.view(torch.int16), combined.view(torch.int16))
        return True
    assert moe_ep.LocalWorld(4, 2).run(fn) == [True] * 4


def test_hooks_and_split_halves():
    def fn(g):
        events = []
        cache, d = make_dispatcher(g, mode="auto")
        d.add_hook("after_dispatch_a", lambda info: events.append(("hook", info["point"], info["micro_batch"],
                                                                   info["mode"])))
        d.add_hook("after_combine_a", lambda info: events.append(("hook", info["point"], info["micro_batch"],
                                                                  info["mode"])))
        inputs = ref.make_inputs(g.size(), 12, H, E, K, 8)
        x, idx, w = inputs[g.rank()]
        events.append("dispatch")
        out = d.dispatch(x, idx, w, kind="decode")
        events.append("dispatched")
        d.combine(torch.zeros_like(out.hidden_states))
        events.append("combined")
        assert events == ["dispatch", ("hook", "after_dispatch_a", 0, "low_latency"), "dispatched",
                          ("hook", "after_combine_a", 0, "low_latency"), "combined"], events
        # the split API leaves the gap to the caller: no hook runs
        events.clear()
        check_round(g, d, "prefill", 9, "normal", split=True)
        assert events == []
        # out of order: StateError
        with pytest.raises(moe_ep.StateError):
            d.dispatch_b(0)
        with pytest.raises(moe_ep.StateError):
            d.combine_a(torch.zeros(1, H, dtype=torch.bfloat16), 0)
        d.dispatch_a(x, idx, w, kind="prefill")
        with pytest.raises(moe_ep.StateError):
            d.dispatch_a(x, idx, w, kind="prefill")
        out = d.dispatch_b(0)
        d.combine(torch.zeros_like(out.hidden_states))
        with pytest.raises(moe_ep.InvalidArgument):
            d.add_hook("before_everything", lambda info: None)
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_two_micro_batches(use_v2):
    def fn(g):
        cache, d = make_dispatcher(g, use_v2=use_v2, mode="normal")
        a = ref.make_inputs(g.size(), 12, H, E, K, 10)
        b = ref.make_inputs(g.size(), 12, H, E, K, 11)
        r = g.rank()
        d.dispatch_a(*a[r], kind="prefill", micro_batch=0)
        d.dispatch_a(*b[r], kind="prefill", micro_batch=1)
        oa, ob = d.dispatch_b(0), d.dispatch_b(1)
        assert_same(oa.hidden_states, ref.v1_dispatch(a, r, E)["recv_x"], "micro-batch 0")
        assert_same(ob.hidden_states, ref.v1_dispatch(b, r, E)["recv_x"], "micro-batch 1")
        d.combine_a(oa.hidden_states, 0)
        d.combine_a(ob.hidden_states, 1)
        ca, cb = d.combine_b(0), d.combine_b(1)
        assert_same(ca, ref.combine_rank(a, r, E, rank_rows_of=lambda dd, t: a[r][0][t]), "combined 0")
        assert_same(cb, ref.combine_rank(b, r, E, rank_rows_of=lambda dd, t: b[r][0][t]), "combined 1")
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_dispatcher_validation():
    def fn(g):
        cache, d = make_dispatcher(g, mode="low_latency")
        x = torch.zeros(CAP + 1, H, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1, 2, 3]] * (CAP + 1))
        with pytest.raises(moe_ep.InvalidArgument, match="MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"):
            d.dispatch(x, idx, torch.ones(CAP + 1, K), kind="decode")
        with pytest.raises((moe_ep.InvalidArgument, TypeError), match="topk_idx"):
            d.dispatch(x[:4], idx[:4].float(), torch.ones(4, K), kind="decode")
        with pytest.raises(moe_ep.InvalidArgument, match="kind"):
            d.dispatch(x[:4], idx[:4], torch.ones(4, K), kind="training")
        # after the refusals, a batch goes through
        check_round(g, d, "decode", 12, "low_latency")
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_use_v2_from_environment():
    """MOE_EP_USE_V2=1 (read when the dispatcher is built) selects V2; checked in a fresh interpreter."""
    code = (
        "import moe_ep, torch\n"
        "def fn(g):\n"
        "    c = moe_ep.BufferCache(g)\n"
        "    d = moe_ep.TokenDispatcher(c, 256, 8, 2, num_max_dispatch_tokens_per_rank=8,"
        " num_max_prefill_tokens_per_rank=16)\n"
        "    x = torch.ones(4, 256, dtype=torch.bfloat16)\n"
        "    idx = torch.tensor([[0, 5], [1, 4], [2, -1], [7, 6]])\n"
        "    o = d.dispatch(x, idx, torch.ones(4, 2), kind='prefill')\n"
        "    y = d.combine(o.hidden_states)\n"
        "    assert torch.equal(y[:2], 2 * x[:2]) and torch.equal(y[2], x[2]), y[:, 0]\n"
        "    return d.generation, o.generation, c.stats()['current_generation']\n"
        "print(moe_ep.LocalWorld(2).run(fn)[0])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PYTHON_DIR, ALIAS_DIR]))
    for value, want in (("1", "V2"), ("0", "V1")):
        env["MOE_EP_USE_V2"] = value
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == str((want, want, want)), p.stdout


# ---- providers --------------------------------------------------------------------------------

def test_probe_providers_states():
    v1_only, both, none = (provider_library(n) for n in ("v1_only", "both", "none"))
    for path in (v1_only, both, none):
        assert os.path.exists(path), f"test provider library missing: {path} (built with the C++ tests)"
    r = moe_ep.probe_providers(v1_only)
    assert r["v1"]["available"] and r["v1"]["provider"] == "test-v1" and r["v1"]["origin"] == v1_only
    assert not r["v2"]["available"] and "offers V1 only" in r["v2"]["reason"] and v1_only in r["v2"]["reason"]
    r = moe_ep.probe_providers(both)
    assert r["v1"]["available"] and r["v2"]["available"]
    assert r["v1"]["provider"] == r["v2"]["provider"] == "test-both"
    r = moe_ep.probe_providers(none)
    assert not r["v1"]["available"] and not r["v2"]["available"]
    assert "offers neither" in r["v1"]["reason"] and "offers neither" in r["v2"]["reason"]
    r = moe_ep.probe_providers("")
    assert r["v1"]["provider"] == r["v2"]["provider"] == "cpu" and r["v1"]["available"] and r["v2"]["available"]
    r = moe_ep.probe_providers("cpu")
    assert r["v1"]["available"] and r["v2"]["available"]
    r = moe_ep.probe_providers("/nonexistent/libnothing.so")
    assert not r["v1"]["available"] and "cannot load library" in r["v1"]["reason"]
    # first provider offering a generation wins
    r = moe_ep.probe_providers(f"{v1_only}:cpu")
    assert r["v1"]["provider"] == "test-v1" and r["v2"]["provider"] == "cpu"
    r = moe_ep.probe_providers(provider_library("no_symbol"))
    assert "missing symbol moe_ep_provider_abi_6" in r["v1"]["reason"]
    r = moe_ep.probe_providers(provider_library("abi_mismatch"))
    assert "ABI mismatch" in r["v1"]["reason"]
    r = moe_ep.probe_providers(provider_library("init_failure"))
    assert "init failed" in r["v1"]["reason"] and "no accelerator found" in r["v1"]["reason"]


@pytest.mark.parametrize("which,use_v2,works", [
    ("v1_only", False, True), ("v1_only", True, False), ("both", False, True), ("both", True, True),
    ("none", False, False), ("none", True, False)])
def test_v2_opt_in_through_providers(which, use_v2, works):
    path = provider_library(which)

    def fn(g):
        cache, d = make_dispatcher(g, use_v2=use_v2, mode="normal", provider_path=path)
        if works:
            check_round(g, d, "prefill", 13, "normal")
            s = cache.stats()
            assert s["current_provider"] == {"v1_only": "test-v1", "both": "test-both"}[which]
            assert s["current_generation"] == ("V2" if use_v2 else "V1")
            return "ok"
        x, idx, w = ref.make_inputs(g.size(), 4, H, E, K, 14)[g.rank()]
        with pytest.raises(moe_ep.InvalidArgument) as info:
            d.dispatch(x, idx, w, kind="prefill")
        msg = str(info.value)
        assert "MOE_EP_USE_V2" in msg and path in msg, msg
        return "refused"
    out = moe_ep.LocalWorld(2).run(fn)
    assert out == ["ok" if works else "refused"] * 2


def test_provider_constructor_failure_leaves_cache_empty():
    """provider_both fails to build a V2 buffer of hidden 384 (CapacityError on every rank): nothing is
    published, and a buildable shape then works."""
    path = provider_library("both")

    def fn(g):
        cache = moe_ep.BufferCache(g)
        bad = moe_ep.TokenDispatcher(cache, 384, E, K, use_v2=True, mode="normal", provider_path=path,
                                     num_max_prefill_tokens_per_rank=PREFILL, num_max_dispatch_tokens_per_rank=CAP)
        with pytest.raises(moe_ep.CapacityError):
            bad.dispatch(torch.zeros(2, 384, dtype=torch.bfloat16), torch.tensor([[0, 1, 2, 3]] * 2),
                         torch.ones(2, K), kind="prefill")
        assert cache.stats()["current_generation"] is None
        d = moe_ep.TokenDispatcher(cache, H, E, K, use_v2=True, mode="normal", provider_path=path,
                                   num_max_prefill_tokens_per_rank=PREFILL, num_max_dispatch_tokens_per_rank=CAP)
        check_round(g, d, "prefill", 15, "normal")
        return cache.stats()["builds"]
    assert moe_ep.LocalWorld(2).run(fn) == [1, 1]


def test_env_registry():
    names = {v["name"]: v for v in moe_ep.env()}
    for n in ("MOE_EP_USE_V2", "MOE_EP_MODE", "MOE_EP_TIMEOUT_SECS", "MOE_EP_PROVIDER_PATH",
              "MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "MOE_EP_RANKS_PER_NODE"):
        assert n in names, n
    assert names["MOE_EP_USE_V2"]["default"] == "0" and names["MOE_EP_MODE"]["default"] == "auto"
    assert names["MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"]["default"] == "128"
