"""DeepEP's rules for defaults, `None`, handles and return tuples (docs/python.md, "DeepEP's rules,
one by one"): each rule has a test here or, where a scenario covers it, a pointer to it. Expected
values come from the inputs and the reference (tests/python/reference.py), never from moe-ep."""

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

import reference as ref
from scenarios import assert_same

H, E, K, T, N = 256, 8, 2, 8, 6


def _v2(g, **kw):
    return deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True, **kw)


def _v1(g):
    return deep_ep.Buffer(g, 1 << 24, 0, explicitly_destroy=True)


def _layout_args(buf, idx):
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)


def _on_every_rank(fn, ranks=2, nodes=1):
    return moe_ep.LocalWorld(ranks, nodes).run(fn)


# ---- V2 cached dispatch: the handle gives the shape --------------------------------------------

def test_v2_cached_dispatch_takes_every_shape_argument_from_the_handle():
    """Compact handle, cached call with nothing but x: the rows of the new x land where the
    handle's layout says (scenarios.v2_expanded covers the expanded, aligned case)."""
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, 1)
        again = ref.make_inputs(g.size(), N, H, E, K, 2)
        x, idx, w = inputs[g.rank()]
        buf = _v2(g)
        _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=T)
        recv_x, recv_idx, recv_w, h2, event = buf.dispatch(again[g.rank()][0], handle=handle)
        assert h2 is handle and event.event is None
        # The first call's routing, the new rows.
        expected = ref.v2_dispatch_compact(inputs, g.rank(), E, payload=lambda s: again[s][0])
        assert_same(recv_x, expected["recv_x"], "cached recv_x")
        # topk_idx comes from the handle: the received local ids are those of the first dispatch.
        assert_same(recv_idx, ref.v2_dispatch_compact(inputs, g.rank(), E)["recv_topk_idx"], "cached recv_topk_idx")
        assert recv_w is None  # no topk_weights given to this call
        buf.destroy()
    _on_every_rank(fn)


@pytest.mark.parametrize("given,message", [
    (dict(expert_alignment=1), "expert_alignment = 1 differs from the handle's 4"),
    (dict(num_experts=2 * E), f"num_experts = {2 * E} differs from the handle's {E}"),
    (dict(num_max_tokens_per_rank=2 * T), f"num_max_tokens_per_rank = {2 * T} differs from the handle's {T}"),
    (dict(do_cpu_sync=True), "do_cpu_sync = true is not allowed with a cached handle"),
])
def test_v2_cached_dispatch_refuses_shape_arguments_that_differ(given, message):
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, 1)
        x, idx, w = inputs[g.rank()]
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=2 * T, hidden=H, num_topk=K, explicitly_destroy=True)
        _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=T,
                                          expert_alignment=4, do_expand=True)
        with pytest.raises(moe_ep.InvalidArgument) as info:
            buf.dispatch(x, handle=handle, **given)
        buf.destroy()
        return str(info.value)
    for got in _on_every_rank(fn):
        assert message in got, got


def test_v2_cached_dispatch_refuses_topk_idx_and_expand_of_a_compact_handle():
    def fn(g):
        x, idx, _ = ref.make_inputs(g.size(), N, H, E, K, 1)[g.rank()]
        buf = _v2(g)
        _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
        with pytest.raises(moe_ep.InvalidArgument, match="topk_idx must not be given with a cached handle"):
            buf.dispatch(x, topk_idx=idx, handle=handle)
        with pytest.raises(moe_ep.InvalidArgument, match="do_expand = true differs from the handle's false"):
            buf.dispatch(x, handle=handle, do_expand=True)
        buf.destroy()
    _on_every_rank(fn)


# ---- Events and streams --------------------------------------------------------------------------

def test_v2_previous_event_requires_allocate_on_comm_stream():
    def fn(g):
        x, idx, w = ref.make_inputs(g.size(), N, H, E, K, 1)[g.rank()]
        buf = _v2(g)
        with pytest.raises(moe_ep.InvalidArgument, match="previous_event requires allocate_on_comm_stream = true"):
            buf.dispatch(x, topk_idx=idx, num_experts=E, previous_event=buf.capture())
        # With it, the call runs (and returns the event of the work when asynchronous).
        out = buf.dispatch(x, topk_idx=idx, num_experts=E, previous_event=buf.capture(), allocate_on_comm_stream=True,
                           async_with_compute_stream=True)
        out[4].current_stream_wait()
        buf.destroy()
    _on_every_rank(fn)


@pytest.mark.parametrize("call", ["get_dispatch_layout", "dispatch", "combine"])
def test_v1_allocate_on_comm_stream_requires_previous_event_and_async_finish(call):
    def fn(g):
        x, idx, w = ref.make_inputs(g.size(), N, H, E, K, 1)[g.rank()]
        buf = _v1(g)
        layout = _layout_args(buf, idx)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        calls = {
            "get_dispatch_layout": lambda **kw: buf.get_dispatch_layout(idx, E, **kw),
            "dispatch": lambda **kw: buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout, **kw),
            "combine": lambda **kw: buf.combine(recv_x, handle, **kw),
        }
        with pytest.raises(moe_ep.InvalidArgument, match="allocate_on_comm_stream = true requires previous_event"):
            calls[call](allocate_on_comm_stream=True)
        with pytest.raises(moe_ep.InvalidArgument, match="requires previous_event and async_finish"):
            calls[call](allocate_on_comm_stream=True, previous_event=buf.capture())
        out = calls[call](allocate_on_comm_stream=True, previous_event=buf.capture(), async_finish=True)
        out[-1].current_stream_wait()
        buf.destroy()
    _on_every_rank(fn)


def test_events_returned_without_async_wrap_none():
    """Synchronous calls return EventOverlap(None): DeepEP's shape, and current_stream_wait asserts."""
    def fn(g):
        x, idx, w = ref.make_inputs(g.size(), N, H, E, K, 1)[g.rank()]
        buf = _v2(g)
        *_, event = buf.dispatch(x, topk_idx=idx, num_experts=E)
        assert isinstance(event, deep_ep.EventOverlap) and event.event is None
        with pytest.raises(AssertionError):
            event.current_stream_wait()
        buf.destroy()
    _on_every_rank(fn, ranks=1)


# ---- V1 normal mode ------------------------------------------------------------------------------

def test_v1_cached_dispatch_ignores_layout_tensors_and_returns_nones():
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, 4)
        again = ref.make_inputs(g.size(), N, H, E, K, 5)
        x, idx, w = inputs[g.rank()]
        buf = _v1(g)
        layout = _layout_args(buf, idx)
        *_, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        expected = ref.v1_dispatch(inputs, g.rank(), E, payload=lambda s: again[s][0])["recv_x"]
        for kw in (dict(), layout):  # layout tensors given with a handle are ignored
            out = buf.dispatch(again[g.rank()][0], handle=handle, **kw)
            assert len(out) == 6 and out[1:5] == (None, None, None, None)
            assert_same(out[0], expected, "cached V1 recv_x")
        with pytest.raises(moe_ep.InvalidArgument, match="topk_weights must not be given with a cached handle"):
            buf.dispatch(x, handle=handle, topk_weights=w)
        buf.destroy()
    _on_every_rank(fn)


@pytest.mark.parametrize("nodes", [1, 2])
def test_v1_layout_counts_per_node_only_across_nodes(nodes):
    """num_tokens_per_rdma_rank is None on one node, else the tokens with an expert on each node."""
    def fn(g):
        _, idx, _ = ref.make_inputs(g.size(), N, H, E, K, 6)[g.rank()]
        buf = _v1(g)
        per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, E)
        El = E // g.size()
        exp_rank = [sum(1 for row in idx.tolist() if any(e >= 0 and e // El == r for e in row))
                    for r in range(g.size())]
        assert per_rank.tolist() == exp_rank
        assert per_expert.tolist() == [int((idx == e).sum()) for e in range(E)]
        assert in_rank.dtype == torch.bool and in_rank.shape == (idx.shape[0], g.size())
        if nodes == 1:
            assert per_rdma is None
        else:
            ranks_per_node = g.size() // nodes
            assert per_rdma.tolist() == [
                sum(1 for row in idx.tolist() if any(e >= 0 and e // (El * ranks_per_node) == n for e in row))
                for n in range(nodes)]
        assert event.event is None
        buf.destroy()
    _on_every_rank(fn, ranks=4, nodes=nodes)


# ---- V1 low-latency mode -------------------------------------------------------------------------

def test_v1_low_latency_returns_no_hook_without_return_recv_hook():
    def fn(g):
        x, idx, w = ref.make_inputs(g.size(), N, H, E, K, 7)[g.rank()]
        buf = deep_ep.Buffer(g, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, g.size(), E),
                             low_latency_mode=True, explicitly_destroy=True)
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        assert hook is None and event.event is None
        assert isinstance(handle, tuple) and tuple(handle[2:]) == (T, H, E)
        combined, event, hook = buf.low_latency_combine(torch.zeros_like(recv_x), idx, w, handle)
        assert hook is None and event.event is None
        assert_same(combined, torch.zeros(x.shape[0], H, dtype=torch.bfloat16), "combine of zero expert outputs")
        buf.destroy()
    _on_every_rank(fn)
