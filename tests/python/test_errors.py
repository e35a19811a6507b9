"""Refusals: the right exception class, a message naming the argument, and a buffer that still
works after a call every rank rejected alike; one rank's bad arguments make that rank raise
InvalidArgument and the others PeerError naming it (LocalWorld.run re-raises the root cause)."""

import numpy as np
import pytest
import torch

import moe_ep
from moe_ep import deep_ep

import reference as ref
from scenarios import assert_same, v1_buffer

H, E, K, T, N = 256, 16, 4, 16, 12


def inputs_of(g, seed=0):
    inputs = ref.make_inputs(g.size(), N, H, E, K, seed)
    return inputs, inputs[g.rank()]


def check_v2_works(buf, g, seed=5):
    """A correct dispatch after a refusal: outputs as the reference says."""
    inputs, (x, idx, w) = inputs_of(g, seed)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    exp = ref.v2_dispatch_compact(inputs, g.rank(), E)
    assert_same(recv_x, exp["recv_x"], "recv_x after a refusal")
    assert_same(recv_idx, exp["recv_topk_idx"], "recv_topk_idx after a refusal")
    combined, _, _ = buf.combine(recv_x, handle)
    exp_c = ref.combine_rank(inputs, g.rank(), E, rank_rows_of=lambda d, t: x[t])
    assert_same(combined, exp_c, "combined_x after a refusal")


def check_v1_works(buf, g, seed=6):
    inputs, (x, idx, w) = inputs_of(g, seed)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    exp = ref.v1_dispatch(inputs, g.rank(), E)
    assert_same(recv_x, exp["recv_x"], "V1 recv_x after a refusal")
    assert_same(recv_w, exp["recv_topk_weights"], "V1 recv_topk_weights after a refusal")


def expect(exc, match, fn):
    with pytest.raises(exc, match=match) as info:
        fn()
    return info.value


def v2_buffer(g):
    return deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)


V2_CASES = {
    "topk_idx_float": (lambda x, idx, w: dict(x=x, topk_idx=idx.float(), topk_weights=w, num_experts=E),
                       (moe_ep.InvalidArgument, TypeError), "topk_idx"),
    "topk_idx_bool": (lambda x, idx, w: dict(x=x, topk_idx=idx >= 0, topk_weights=w, num_experts=E),
                      (moe_ep.InvalidArgument, TypeError), "topk_idx"),
    "topk_idx_int32": (lambda x, idx, w: dict(x=x, topk_idx=idx.int(), topk_weights=w, num_experts=E),
                       (moe_ep.InvalidArgument, TypeError), "topk_idx"),
    "x_int64": (lambda x, idx, w: dict(x=x.long(), topk_idx=idx, topk_weights=w, num_experts=E),
                (moe_ep.InvalidArgument, TypeError), r"\bx\b"),
    "x_float64": (lambda x, idx, w: dict(x=x.double(), topk_idx=idx, topk_weights=w, num_experts=E),
                  (moe_ep.InvalidArgument, TypeError), r"\bx\b"),
    "x_bool": (lambda x, idx, w: dict(x=x > 0, topk_idx=idx, topk_weights=w, num_experts=E),
               (moe_ep.InvalidArgument, TypeError), r"\bx\b"),
    "wrong_hidden": (lambda x, idx, w: dict(x=x[:, :128].contiguous(), topk_idx=idx, topk_weights=w, num_experts=E),
                     moe_ep.InvalidArgument, "hidden"),
    "x_not_row_major": (lambda x, idx, w: dict(x=torch.cat([x, x], 1)[:, ::2], topk_idx=idx, topk_weights=w,
                                               num_experts=E), moe_ep.InvalidArgument, r"\bx\b"),
    "experts_not_multiple_of_ranks": (lambda x, idx, w: dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E - 1),
                                      moe_ep.InvalidArgument, "num_experts"),
    "expert_out_of_range": (lambda x, idx, w: dict(x=x, topk_idx=torch.where(idx >= 0, idx + 1, idx) % (E + 1),
                                                   topk_weights=w, num_experts=E), moe_ep.InvalidArgument, "topk_idx"),
    "duplicate_expert": (lambda x, idx, w: dict(x=x, topk_idx=torch.cat([idx[:, :1], idx[:, :1], idx[:, 2:]], 1),
                                                topk_weights=w, num_experts=E), moe_ep.InvalidArgument, "topk_idx"),
    "weights_float64": (lambda x, idx, w: dict(x=x, topk_idx=idx, topk_weights=w.double(), num_experts=E),
                        (moe_ep.InvalidArgument, TypeError), "topk_weights"),
    "weights_wrong_shape": (lambda x, idx, w: dict(x=x, topk_idx=idx, topk_weights=w[:, :2].contiguous(),
                                                   num_experts=E), moe_ep.InvalidArgument, "topk_weights"),
    "too_many_tokens": (lambda x, idx, w: dict(x=torch.cat([x, x]), topk_idx=torch.cat([idx, idx]),
                                               topk_weights=torch.cat([w, w]), num_experts=E),
                        moe_ep.InvalidArgument, "num_max_tokens_per_rank"),
    "topk_idx_list": (lambda x, idx, w: dict(x=x, topk_idx=idx.tolist(), topk_weights=w, num_experts=E),
                      TypeError, "topk_idx"),
    "topk_weights_list": (lambda x, idx, w: dict(x=x, topk_idx=idx, topk_weights=w.tolist(), num_experts=E),
                          TypeError, "topk_weights"),
    "x_list": (lambda x, idx, w: dict(x=x.float().tolist(), topk_idx=idx, topk_weights=w, num_experts=E),
               TypeError, r"\bx\b"),
    "num_sms_too_large": (lambda x, idx, w: dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E, num_sms=100000),
                          moe_ep.InvalidArgument, "num_sms"),
    "zero_padding_without_expand": (lambda x, idx, w: dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                           do_zero_padding=True),
                                    moe_ep.InvalidArgument, "do_zero_padding"),
}


@pytest.mark.parametrize("case", sorted(V2_CASES))
def test_v2_dispatch_refusals(case):
    make, exc, match = V2_CASES[case]

    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        kwargs = make(x, idx, w)
        expect(exc, match, lambda: buf.dispatch(**kwargs))
        check_v2_works(buf, g)
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_v2_combine_refusals():
    def fn(g):
        buf = v2_buffer(g)
        inputs, (x, idx, w) = inputs_of(g)
        recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        M = recv_x.shape[0]
        e = expect(moe_ep.InvalidArgument, str(M), lambda: buf.combine(torch.cat([recv_x, recv_x[:1]]), handle))
        assert str(M + 1) in str(e), "the message names both row counts"
        expect((moe_ep.InvalidArgument, TypeError), r"\bx\b", lambda: buf.combine(recv_x.float(), handle))
        expect(moe_ep.InvalidArgument, "bias", lambda: buf.combine(recv_x, handle, bias=torch.zeros(x.shape[0] + 1, H,
                                                                                                    dtype=torch.bfloat16)))
        expect(TypeError, "handle", lambda: buf.combine(recv_x, None))
        expect(TypeError, "handle", lambda: buf.combine(recv_x, (1, 2)))
        # a handle from another buffer
        other = v2_buffer(g)
        expect(moe_ep.InvalidArgument, "handle", lambda: other.combine(recv_x, handle))
        other.destroy()
        combined, _, _ = buf.combine(recv_x, handle)
        assert_same(combined, ref.combine_rank(inputs, g.rank(), E, rank_rows_of=lambda d, t: x[t]), "combined_x")
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_v2_cached_dispatch_refusals():
    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        expect(moe_ep.InvalidArgument, "topk_idx", lambda: buf.dispatch(x, topk_idx=idx, handle=handle))
        expect(moe_ep.InvalidArgument, "do_cpu_sync", lambda: buf.dispatch(x, handle=handle, do_cpu_sync=True))
        expect(moe_ep.InvalidArgument, "expert_alignment", lambda: buf.dispatch(x, handle=handle, expert_alignment=4))
        expect(moe_ep.InvalidArgument, "token", lambda: buf.dispatch(x[:-1].contiguous(), handle=handle))
        expect(TypeError, "handle", lambda: buf.dispatch(x, handle="handle"))
        check_v2_works(buf, g)
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_wrong_group_kinds():
    for bad in (5, "world", 3.5, None, object()):
        with pytest.raises((TypeError, ValueError)) as info:
            deep_ep.ElasticBuffer(bad, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
        if bad is not None:
            assert isinstance(info.value, TypeError) and "group" in str(info.value)
    for bad in (5, "world"):
        with pytest.raises(TypeError, match="group"):
            deep_ep.Buffer(bad)
        with pytest.raises(TypeError, match="group"):
            moe_ep.BufferCache(bad)
        with pytest.raises(TypeError, match="group"):
            deep_ep.get_physical_domain_size(bad)
        with pytest.raises(TypeError, match="group"):
            moe_ep.resolve_group(bad)
    with pytest.raises(ValueError):
        deep_ep.Buffer(None)  # neither group nor comm
    with pytest.raises(TypeError, match="cache"):
        moe_ep.TokenDispatcher("cache", H, E, K)


def test_local_world_argument_checks():
    with pytest.raises(ValueError):
        moe_ep.LocalWorld(0)
    with pytest.raises(ValueError):
        moe_ep.LocalWorld(4, 3)
    with pytest.raises(TypeError):
        moe_ep.LocalWorld(2).run(42)


def test_v1_refusals():
    def fn(g):
        buf = v1_buffer(g, deep_ep, low_latency_mode=True)
        inputs, (x, idx, w) = inputs_of(g)
        expect((moe_ep.InvalidArgument, TypeError), "topk_idx", lambda: buf.get_dispatch_layout(idx.float(), E))
        expect(moe_ep.InvalidArgument, "topk_idx", lambda: buf.get_dispatch_layout(idx + E, E))
        expect(TypeError, "topk_idx", lambda: buf.get_dispatch_layout(idx.tolist(), E))
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        bad_per_rank = per_rank.clone()
        bad_per_rank[0] += 1
        expect(moe_ep.InvalidArgument, "num_tokens_per_rank", lambda: buf.dispatch(
            x, num_tokens_per_rank=bad_per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w))
        expect((moe_ep.InvalidArgument, TypeError), "is_token_in_rank", lambda: buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank.int(), num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w))
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        M = recv_x.shape[0]
        expect(moe_ep.InvalidArgument, str(M), lambda: buf.combine(recv_x[:-1].contiguous(), handle))
        expect(TypeError, "handle", lambda: buf.combine(recv_x, "handle"))
        check_v1_works(buf, g)
        # low-latency refusals
        cap = 16
        expect(moe_ep.InvalidArgument, "num_max_dispatch_tokens_per_rank|tokens", lambda: buf.low_latency_dispatch(
            torch.cat([x, x]), torch.cat([idx, idx]), cap, E, use_fp8=False))
        expect(moe_ep.InvalidArgument, "use_ue8m0|round_scale", lambda: buf.low_latency_dispatch(
            x, idx, cap, E, use_fp8=True, use_ue8m0=True))
        expect(moe_ep.InvalidArgument, "async_finish|return_recv_hook", lambda: buf.low_latency_dispatch(
            x, idx, cap, E, use_fp8=False, async_finish=True, return_recv_hook=True))
        recv, count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, cap, E, use_fp8=False)
        expect(moe_ep.InvalidArgument, "use_logfmt.*zero_copy", lambda: buf.low_latency_combine(
            recv, idx, w, ll_handle, use_logfmt=True, zero_copy=True))
        expect(TypeError, "handle", lambda: buf.low_latency_combine(recv, idx, w, None))
        # after the refusals the low-latency path works
        recv, count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, cap, E, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, idx, w, ll_handle)
        assert out.shape == (x.shape[0], H)
        buf.destroy()
        expect(moe_ep.StateError, "destroy", lambda: buf.get_dispatch_layout(idx, E))
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_destroyed_buffer_is_state_error():
    def fn(g):
        buf = v2_buffer(g)
        buf.destroy()
        _, (x, idx, w) = inputs_of(g)
        expect(moe_ep.StateError, "destroy", lambda: buf.dispatch(x, topk_idx=idx, num_experts=E))
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_capacity_error_v1_across_nodes():
    """Normal mode across nodes needs SO x T x record bytes of the scale-out pool: on more than 8 ranks
    (DeepEP's internode sizing; on fewer the pool grows, docs/legacy.md §1) a call beyond it is a
    CapacityError (required > available) on every rank, and a smaller call then works."""
    def fn(g):
        big = 64
        inputs = ref.make_inputs(g.size(), big, 1024, E, K, 70, vary=False)
        x, idx, w = inputs[g.rank()]
        buf = deep_ep.Buffer(g, 1 << 20, 128 << 10, explicitly_destroy=True)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        e = expect(moe_ep.CapacityError, r"this call needs \d+ bytes of buffer", lambda: buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w))
        assert e.required_bytes > e.available_bytes, (e.required_bytes, e.available_bytes)
        assert isinstance(e, moe_ep.InvalidArgument)
        small = [(xx[:4].contiguous(), ii[:4].contiguous(), ww[:4].contiguous()) for xx, ii, ww in inputs]
        x, idx, w = small[g.rank()]
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, _, _, _, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                             topk_idx=idx, topk_weights=w)
        assert_same(recv_x, ref.v1_dispatch(small, g.rank(), E)["recv_x"], "recv_x after a CapacityError")
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(16, 2).run(fn) == [True] * 16


def test_capacity_error_v1_low_latency():
    def fn(g):
        inputs, (x, idx, w) = inputs_of(g)
        need = deep_ep.Buffer.get_low_latency_rdma_size_hint(16, H, g.size(), E)
        buf = deep_ep.Buffer(g, 0, (need // 4) // 128 * 128, low_latency_mode=True, explicitly_destroy=True)
        e = expect(moe_ep.CapacityError, r"need num_rdma_bytes >= \d+", lambda: buf.low_latency_dispatch(x, idx, 16, E, use_fp8=False))
        assert e.required_bytes > e.available_bytes
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_capacity_error_v2():
    """A 2 MiB V2 buffer cannot hold the cross-node records of 2048 tokens of hidden 2048."""
    def fn(g):
        try:
            buf = deep_ep.ElasticBuffer(g, num_bytes=2 << 20, num_max_tokens_per_rank=2048, hidden=2048, num_topk=K,
                                        explicitly_destroy=True)
        except moe_ep.CapacityError as e:  # refused at construction: also DeepEP's rule (the call's needs)
            assert e.required_bytes > e.available_bytes
            return "construction"
        inputs = ref.make_inputs(g.size(), 2048, 2048, E, K, 71, vary=False, mask_every=0)
        x, idx, w = inputs[g.rank()]
        e = expect(moe_ep.CapacityError, r"this call needs \d+ bytes of buffer", lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E))
        assert e.required_bytes > e.available_bytes
        buf.destroy()
        return "call"
    out = moe_ep.LocalWorld(4, 2).run(fn)
    assert len(set(out)) == 1


def test_one_rank_bad_arguments_peers_get_peer_error():
    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        bad_idx = idx.float() if g.rank() == 1 else idx
        try:
            buf.dispatch(x, topk_idx=bad_idx, topk_weights=w, num_experts=E)
            got = ("no error",)
        except moe_ep.Error as e:
            got = (type(e).__name__, list(getattr(e, "ranks", [])), str(e))
        check_v2_works(buf, g)  # every rank learnt of the refusal in the agreement: the buffer is usable
        buf.destroy()
        return got
    out = moe_ep.LocalWorld(4).run(fn)
    assert out[1][0] == "InvalidArgument" and "topk_idx" in out[1][2], out[1]
    for r in (0, 2, 3):
        assert out[r][0] == "PeerError", out[r]
        assert out[r][1] == [1], f"rank {r}: PeerError.ranks = {out[r][1]}"
        assert "1" in out[r][2]


def test_one_rank_bad_arguments_root_cause_reraised():
    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        w_bad = w[:, :2].contiguous() if g.rank() == 2 else w
        buf.dispatch(x, topk_idx=idx, topk_weights=w_bad, num_experts=E)
        buf.destroy()
    with pytest.raises(moe_ep.InvalidArgument, match="topk_weights"):
        moe_ep.LocalWorld(4).run(fn)


def test_one_rank_num_sms_out_of_range():
    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_sms=5000 if g.rank() == 0 else 0)
            got = ("none", [])
        except moe_ep.Error as e:
            got = (type(e).__name__, list(getattr(e, "ranks", [])))
        buf.destroy()
        return got
    out = moe_ep.LocalWorld(2).run(fn)
    assert out == [("InvalidArgument", []), ("PeerError", [0])]


def test_v1_one_rank_bad_layout():
    def fn(g):
        buf = v1_buffer(g, deep_ep)
        _, (x, idx, w) = inputs_of(g)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        if g.rank() == 0:
            per_expert = per_expert.clone()
            per_expert[0] += 3
        try:
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=w)
            got = ("none", [], "")
        except moe_ep.Error as e:
            got = (type(e).__name__, list(getattr(e, "ranks", [])), str(e))
        check_v1_works(buf, g)
        buf.destroy()
        return got
    out = moe_ep.LocalWorld(2).run(fn)
    assert out[0][0] == "InvalidArgument" and "num_tokens_per_expert" in out[0][2]
    assert out[1][:2] == ("PeerError", [0])


def test_python_exception_on_one_rank():
    """A plain Python exception on one rank: the others fail with PeerError instead of hanging, and
    run() re-raises the original exception."""
    class Boom(Exception):
        pass

    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        if g.rank() == 1:
            raise Boom("rank 1 gives up")
        with pytest.raises(moe_ep.PeerError) as info:
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        assert 1 in info.value.ranks
        raise info.value
    with pytest.raises(Boom, match="rank 1 gives up"):
        moe_ep.LocalWorld(2).run(fn)


def test_numpy_inputs_accepted_and_checked():
    def fn(g):
        buf = v2_buffer(g)
        inputs, (x, idx, w) = inputs_of(g)
        recv_x, recv_idx, recv_w, _, _ = buf.dispatch(x, topk_idx=idx.numpy(), topk_weights=w.numpy(), num_experts=E)
        exp = ref.v2_dispatch_compact(inputs, g.rank(), E)
        assert_same(recv_x, exp["recv_x"], "recv_x (numpy routing)")
        assert_same(recv_w, exp["recv_topk_weights"], "recv_topk_weights (numpy routing)")
        expect((moe_ep.InvalidArgument, TypeError), "topk_idx", lambda: buf.dispatch(
            x, topk_idx=idx.numpy().astype(np.float64), topk_weights=w.numpy(), num_experts=E))
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_one_rank_unimportable_argument():
    """A refusal while the arguments are read (a dtype moe-ep does not move) is also an argument
    error of that rank: it raises TypeError naming the argument and the dtype, its peers PeerError
    naming it, and the next calls pair up."""
    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=w.double() if g.rank() == 1 else w, num_experts=E)
            got = ("none", [], "")
        except (moe_ep.Error, TypeError) as e:
            got = (type(e).__name__, list(getattr(e, "ranks", [])), str(e))
        check_v2_works(buf, g)
        buf.destroy()
        return got
    out = moe_ep.LocalWorld(2).run(fn)
    assert [o[:2] for o in out] == [("PeerError", [1]), ("TypeError", [])]
    assert "topk_weights has dtype torch.float64" in out[1][2], out[1][2]
    assert "rank 1" in out[0][2] and "topk_weights has dtype torch.float64" in out[0][2], out[0][2]
