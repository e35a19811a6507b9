"""Shrink mode (Buffer(enable_shrink=True)): the mask calls, and low-latency dispatch and combine
with masked peers against a dense reference that leaves the masked pairs out (written here from
docs/legacy.md §4: a token of rank s and an expert of rank d are kept apart when either rank
masks the other), with every rank masking one rank (DeepEP's simulated failure) and with one
rank masking another; then the refusals."""

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

import reference as ref

H, E, K, CAP, N = 128, 16, 4, 12, 10


def _buffer(g, shrink=True):
    return deep_ep.Buffer(g, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(CAP, H, g.size(), E),
                          low_latency_mode=True, num_qps_per_rank=E // g.size(), explicitly_destroy=True,
                          enable_shrink=shrink)


def _kept(inputs, masks):
    """The inputs with the lanes of kept-apart pairs set to -1 (masks[r]: the ranks r masks)."""
    R = len(inputs)
    apart = [[d in masks[s] or s in masks[d] for d in range(R)] for s in range(R)]
    kept = []
    for s, (x, idx, w) in enumerate(inputs):
        owner = torch.div(idx.clamp(min=0), E // R, rounding_mode="floor")
        cut = torch.tensor([[idx[t, j] >= 0 and apart[s][int(owner[t, j])] for j in range(idx.shape[1])]
                            for t in range(idx.shape[0])], dtype=torch.bool).reshape(idx.shape)
        kept.append((x, idx.masked_fill(cut, -1), w))
    return kept


def _round_trip(g, buf, inputs, masks):
    """Dispatch and combine through buf; checks the slab and the result against the reference of
    `masks` (the masks in force during the dispatch)."""
    x, idx, w = inputs[g.rank()]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False)
    kept = _kept(inputs, masks)
    El = E // g.size()
    expected = ref.ll_expert_tokens(kept, g.rank(), E)
    y = torch.zeros_like(recv_x)
    for le in range(El):
        m = int(count[le])
        assert m == len(expected[le]), (g.rank(), le, m, expected[le])
        for i, (s, t) in enumerate(expected[le]):
            assert torch.equal(recv_x[le, i].view(torch.int16), inputs[s][0][t].view(torch.int16))
            y[le, i] = ref.expert_transform(recv_x[le, i], g.rank() * El + le)
    combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
    want = ref.ll_combine(kept, g.rank(), E, lambda t, e: ref.expert_transform(x[t], e))
    assert torch.equal(combined.view(torch.int16), want.view(torch.int16)), g.rank()


def _mask_of(buf, R):
    status = torch.full((R,), -5, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    return {r for r in range(R) if int(status[r]) == 1} if bool(((status == 0) | (status == 1)).all()) else None


@pytest.mark.parametrize("ranks,nodes", [(4, 1), (4, 2)])
def test_every_rank_masks_one(ranks, nodes):
    """DeepEP's simulated failure: every rank masks the last one; nobody sends to it or reads from
    it, and its own calls move nothing. Unmasking restores the full results."""
    failed = ranks - 1

    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=71)
        buf = _buffer(g)
        assert _mask_of(buf, g.size()) == set()
        buf.low_latency_update_mask_buffer(failed, True)
        assert _mask_of(buf, g.size()) == {failed}
        masks = [{failed}] * g.size()
        _round_trip(g, buf, inputs, masks)
        _round_trip(g, buf, inputs, masks)  # both slots
        buf.low_latency_clean_mask_buffer()
        assert _mask_of(buf, g.size()) == set()
        _round_trip(g, buf, inputs, [set()] * g.size())
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(ranks, nodes).run(fn) == [True] * ranks


@pytest.mark.parametrize("ranks,nodes", [(2, 1), (4, 2)])
def test_one_rank_masks_another(ranks, nodes):
    """Rank 0 alone masks rank 1: the pair is kept apart both ways, and after the dispatch rank 1
    masks rank 0 as well (it learned that rank 0 masked it); unmasking on both restores all."""
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=73)
        buf = _buffer(g)
        if g.rank() == 0:
            buf.low_latency_update_mask_buffer(1, True)
        masks = [{1}] + [set()] * (g.size() - 1)
        _round_trip(g, buf, inputs, masks)
        learned = _mask_of(buf, g.size())
        assert learned == ({1} if g.rank() == 0 else {0} if g.rank() == 1 else set()), (g.rank(), learned)
        _round_trip(g, buf, inputs, [{1}, {0}] + [set()] * (g.size() - 2))
        if g.rank() in (0, 1):
            buf.low_latency_update_mask_buffer(1 - g.rank(), False)
        _round_trip(g, buf, inputs, [set()] * g.size())
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(ranks, nodes).run(fn) == [True] * ranks


def test_mask_calls_refusals():
    def fn(g):
        out = []
        plain = _buffer(g, shrink=False)
        for call in (lambda: plain.low_latency_update_mask_buffer(0, True),
                     lambda: plain.low_latency_query_mask_buffer(torch.zeros(2, dtype=torch.int32)),
                     lambda: plain.low_latency_clean_mask_buffer()):
            with pytest.raises(moe_ep.StateError, match="enable_shrink = false"):
                call()
        buf = _buffer(g)
        with pytest.raises(moe_ep.InvalidArgument, match=r"rank_to_mask = 2 is outside \[0, 2\)"):
            buf.low_latency_update_mask_buffer(2, True)
        with pytest.raises(moe_ep.InvalidArgument, match=r"rank_to_mask = -1 is outside"):
            buf.low_latency_update_mask_buffer(-1, True)
        with pytest.raises(moe_ep.InvalidArgument, match="mask_status"):
            buf.low_latency_query_mask_buffer(torch.zeros(3, dtype=torch.int32))
        with pytest.raises(moe_ep.InvalidArgument, match="mask_status"):
            buf.low_latency_query_mask_buffer(torch.zeros(2, dtype=torch.int64))
        with pytest.raises(TypeError, match="mask_status"):
            buf.low_latency_query_mask_buffer([0, 0])
        plain.destroy()
        buf.destroy()
        with pytest.raises(moe_ep.StateError):
            buf.low_latency_clean_mask_buffer()
        out.append(True)
        return out
    assert moe_ep.LocalWorld(2).run(fn) == [[True], [True]]


def test_enable_shrink_must_agree():
    def fn(g):
        try:
            _buffer(g, shrink=g.rank() == 0)
        except moe_ep.PeerError as e:
            return type(e).__name__, "enable_shrink" in str(e)
        except moe_ep.Error as e:
            return type(e).__name__, "enable_shrink" in str(e)
        return "ok", False
    results = moe_ep.LocalWorld(2).run(fn)
    assert all(named for _, named in results) and all(kind != "ok" for kind, _ in results), results
