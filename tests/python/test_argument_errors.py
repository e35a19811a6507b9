"""Arguments the Python layer cannot convert (docs/python.md, "Errors"): tensors torch does not
export through DLPack (meta device, sparse layouts, nested and quantized tensors) and a non-tensor
given to empty_like. Each is the documented class naming the argument; in a collective call the
rank that passed it raises it and its peers PeerError naming that rank, after which the buffer
still works (ranks as threads)."""

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

from scenarios import v1_buffer
from test_dispatcher import check_round, make_dispatcher
from test_errors import E, H, check_v1_works, check_v2_works, inputs_of, v2_buffer

# What torch will not export through DLPack, and the words naming it in the refusal.
UNEXPORTABLE = {
    "meta": (lambda t: t.to("meta"), "device meta"),
    "sparse_coo": (lambda t: t.to_sparse(), "layout torch.sparse_coo"),
    "sparse_csr": (lambda t: t.to_sparse_csr(), "layout torch.sparse_csr"),
    "nested": (lambda t: torch.nested.nested_tensor([t[0], t[1][:-1]]), "nested tensor"),
    "quantized": (lambda t: torch.quantize_per_tensor(t.float(), 0.5, 0, torch.qint8), "dtype torch.qint8"),
}


def outcome(fn):
    """("ok",) or (class name, message, ranks named by a PeerError)."""
    try:
        fn()
        return ("ok",)
    except moe_ep.PeerError as e:
        return ("PeerError", str(e), list(e.ranks))
    except Exception as e:  # the test compares each rank's class and message
        return (type(e).__name__, str(e), [])


def expect_refused(results, kind, *words, bad_rank=0, peers_see_words=True):
    """bad_rank raised `kind` with a message holding the words; every other rank PeerError naming
    bad_rank (and the words, when peers_see_words)."""
    for r, (name, *rest) in enumerate(results):
        message, ranks = rest if rest else ("", [])
        if r == bad_rank:
            assert name == kind, results
        else:
            assert name == "PeerError" and ranks == [bad_rank], results
            assert f"rank {bad_rank}" in message, message
        for w in words if r == bad_rank or peers_see_words else ():
            assert w in message, (r, w, message)


# ---- tensors torch does not export ----------------------------------------------------------


# torch quantizes float tensors only: no quantized topk_idx.
@pytest.mark.parametrize("arg,kind", [("x", k) for k in sorted(UNEXPORTABLE)] +
                         [("topk_idx", k) for k in sorted(UNEXPORTABLE) if k != "quantized"])
def test_v2_dispatch_refuses_unexportable_tensors(arg, kind):
    make, words = UNEXPORTABLE[kind]

    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        args = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E)
        if g.rank() == 0:
            args[arg] = make(args[arg])
        got = outcome(lambda: buf.dispatch(**args))
        check_v2_works(buf, g)
        buf.destroy()
        return got
    expect_refused(moe_ep.LocalWorld(2).run(fn), "TypeError", arg, words)


@pytest.mark.parametrize("kind", ["meta", "sparse_coo"])
def test_v2_combine_refuses_unexportable_tensors(kind):
    make, words = UNEXPORTABLE[kind]

    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        got = outcome(lambda: buf.combine(make(recv_x) if g.rank() == 0 else recv_x, handle))
        check_v2_works(buf, g)
        buf.destroy()
        return got
    expect_refused(moe_ep.LocalWorld(2).run(fn), "TypeError", "x", words)


@pytest.mark.parametrize("kind", ["meta", "sparse_coo", "nested"])
def test_v1_calls_refuse_unexportable_tensors(kind):
    make, words = UNEXPORTABLE[kind]

    def fn(g):
        buf = v1_buffer(g, deep_ep, low_latency_mode=True)
        _, (x, idx, w) = inputs_of(g)
        bad = g.rank() == 0
        layout = outcome(lambda: buf.get_dispatch_layout(make(idx) if bad else idx, E))  # local: no peer
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        normal = outcome(lambda: buf.dispatch(make(x) if bad else x, num_tokens_per_rank=per_rank,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=idx, topk_weights=w))
        check_v1_works(buf, g)
        buf.clean_low_latency_buffer(16, H, E)
        low_latency = outcome(lambda: buf.low_latency_dispatch(make(x) if bad else x, idx, 16, E, use_fp8=False))
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 16, E, use_fp8=False)
        assert recv.shape == (E // g.size(), g.size() * 16, H)
        buf.destroy()
        return layout, normal, low_latency
    layout, normal, low_latency = zip(*moe_ep.LocalWorld(2).run(fn))
    assert layout[0][0] == "TypeError" and "topk_idx" in layout[0][1] and words in layout[0][1], layout
    assert layout[1] == ("ok",), layout
    expect_refused(normal, "TypeError", "x", words)
    expect_refused(low_latency, "TypeError", "x", words)


def test_dispatcher_refuses_unexportable_tensors():
    def fn(g):
        cache, d = make_dispatcher(g)
        _, (x, idx, w) = inputs_of(g)
        got = outcome(lambda: d.dispatch(x.to("meta") if g.rank() == 0 else x, idx, w))
        check_round(g, d, "prefill", 3, "normal")  # the group goes on
        cache.destroy()
        return got
    # The C++ dispatcher takes no rejection message: the peers learn that rank 0's tensors were
    # refused ("x is missing"), not why.
    expect_refused(moe_ep.LocalWorld(2).run(fn), "TypeError", "hidden_states", "device meta", peers_see_words=False)


def test_empty_like_takes_dense_torch_tensors():
    for bad, words in (([1, 2], "t must be a torch.Tensor, not list"), ("x", "not str"),
                       (torch.zeros(3, 4).to_sparse(), "layout torch.sparse_coo")):
        with pytest.raises(TypeError, match="^t ") as info:
            moe_ep.empty_like(bad)
        assert words in str(info.value), str(info.value)
    like = moe_ep.empty_like(torch.zeros(3, 4, dtype=torch.float16, device="meta"))  # shape and dtype only
    assert (like.shape, like.dtype, like.device.type) == ((3, 4), torch.float16, "cpu")

