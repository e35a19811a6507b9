"""The V2 (ElasticBuffer) scenarios: a compact and an expanded dispatch, their combine and a cached
dispatch with the handle."""
import numpy as np
import torch

import reference as ref

from .common import _biases, _fp8_pair, assert_same, group_info


def v2_compact(group, deep_ep, base_tokens=12, hidden=256, num_experts=16, num_topk=4, T=16, do_cpu_sync=True,
               fp8=False, bias=True, weights=True, seed=0, allow_hybrid_mode=True, cached=True, async_=False):
    rank, R, SU, SO = group_info(group)
    inputs = ref.make_inputs(R, base_tokens, hidden, num_experts, num_topk, seed)
    x, idx, w = inputs[rank]
    E, k = num_experts, num_topk
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=hidden, num_topk=k, use_fp8_dispatch=fp8,
                                allow_hybrid_mode=allow_hybrid_mode, explicitly_destroy=True)
    hybrid = allow_hybrid_mode and SO > 1
    assert buf.get_logical_domain_size() == ((SO, SU) if allow_hybrid_mode else (1, R))
    pairs = [_fp8_pair(inputs[s][0], s) for s in range(R)] if fp8 else None
    xin = pairs[rank] if fp8 else x
    kwargs = dict(topk_idx=idx, topk_weights=w if weights else None, num_experts=E)
    if do_cpu_sync is not None:
        kwargs["do_cpu_sync"] = do_cpu_sync
    if async_:
        kwargs.update(previous_event=buf.capture(), async_with_compute_stream=True, allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(xin, **kwargs)
    if async_:
        event.current_stream_wait()
    exp = ref.v2_dispatch_compact(inputs, rank, E, payload=(lambda s: pairs[s][0]) if fp8 else None)
    M = len(exp["rows"])
    sync = do_cpu_sync is None or do_cpu_sync
    rows_out = M if sync else T * R
    recv_x = _check_compact_rows(recv_x, recv_idx, recv_w, exp, pairs, rows_out, hidden, k, weights)
    # prefix over scale-up indices of the rows received from sources s with s % SU == r
    LSU = SU if allow_hybrid_mode else R  # the logical scale-up domain
    _check_compact_handle(handle, recv_idx, exp, inputs, rank, E, T, LSU, sync)
    if not fp8:
        _combine_compact(buf, handle, recv_x, recv_w, inputs, rank, E, M, rows_out, bias, weights, async_,
                         SU if hybrid else None)
    if cached and sync:
        # cached dispatch: new activations and weights, routing from the handle
        inputs2 = ref.make_inputs(R, base_tokens, hidden, E, k, seed + 17)
        x2 = inputs2[rank][0]
        w2 = torch.rand(x.shape[0], k) + 1.0
        pairs2 = [_fp8_pair(inputs2[s][0], 100 + s) for s in range(R)] if fp8 else None
        xin2 = pairs2[rank] if fp8 else x2
        rx2, ridx2, rw2, h2, _ = buf.dispatch(xin2, topk_weights=w2 if weights else None, handle=handle)
        assert h2 is handle, "a cached dispatch returns the same handle object"
        if fp8:
            rx2 = rx2[0]
        payload = (lambda s: pairs2[s][0]) if fp8 else (lambda s: inputs2[s][0])
        exp2 = torch.stack([payload(s)[t] for s, t in exp["rows"]]) if M else exp["recv_x"][:0]
        assert_same(rx2[:M], exp2, "cached dispatch recv_x")
    buf.destroy()
    return {"rank": rank, "M": M}


def _check_compact_rows(recv_x, recv_idx, recv_w, exp, pairs, rows_out, hidden, k, weights):
    """A compact V2 dispatch's rows, scales (FP8), ids and weights against the reference; returns
    recv_x without its scales."""
    M = len(exp["rows"])
    if pairs:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2, "FP8 dispatch returns (recv_x, recv_x_scales)"
        recv_x, recv_sf = recv_x
        exp_sf = torch.stack([pairs[s][1][t] for s, t in exp["rows"]]) if M else torch.empty(0, hidden // 128)
        assert recv_sf.shape[0] == rows_out
        assert_same(recv_sf[:M].contiguous(), exp_sf, "recv_x_scales")
    assert recv_x.shape == (rows_out, hidden), f"recv_x shape {tuple(recv_x.shape)}, expected {(rows_out, hidden)}"
    assert_same(recv_x[:M], exp["recv_x"], "recv_x")
    assert recv_idx.shape == (rows_out, k)
    assert_same(recv_idx[:M], exp["recv_topk_idx"], "recv_topk_idx")
    if weights:
        assert_same(recv_w[:M], exp["recv_topk_weights"], "recv_topk_weights")
    else:
        assert recv_w is None
    return recv_x


def _check_compact_handle(handle, recv_idx, exp, inputs, rank, E, T, LSU, sync):
    """A compact V2 dispatch's handle: counts, prefix sums over the logical scale-up domain (LSU
    ranks), the source metadata and the routing."""
    M, R, k = len(exp["rows"]), len(inputs), inputs[rank][1].shape[1]
    assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == M
    if sync:
        assert handle.num_recv_tokens == M
        assert list(handle.num_recv_tokens_per_expert_list) == exp["counts"]
        assert handle.num_unaligned_recv_tokens_per_expert.tolist() == exp["counts"]
        assert handle.psum_num_recv_tokens_per_expert.tolist() == np.cumsum(exp["counts"]).tolist()
    else:
        assert handle.num_recv_tokens == T * R
        assert list(handle.num_recv_tokens_per_expert_list) == []
        assert bool((recv_idx[M:] == -1).all()), "rows past the real count must have recv_topk_idx -1"
    per_su = [sum(1 for s, _ in exp["rows"] if s % LSU == r) for r in range(LSU)]
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == np.cumsum(per_su).tolist()
    meta = handle.recv_src_metadata
    own = lambda e: ref.owner(e, E, R)
    exp_meta0 = [s * T + t for s, t in exp["rows"]]
    exp_meta1 = [s * k + ref.master_lane(inputs[s][1][t], own, rank) for s, t in exp["rows"]]
    assert meta[:M, 0].tolist() == exp_meta0, "recv_src_metadata[:, 0] = src_rank * T + src_token"
    assert meta[:M, 1].tolist() == exp_meta1, "recv_src_metadata[:, 1] = src_rank * k + master lane"
    assert handle.topk_idx.tolist() == inputs[rank][1].tolist()


def _combine_compact(buf, handle, recv_x, recv_w, inputs, rank, E, M, rows_out, bias, weights, async_,
                     ranks_per_node):
    """Combine after a compact V2 dispatch: each destination returns f(its received row); weights
    come back per lane."""
    x, _, w = inputs[rank]
    hidden, k = x.shape[1], w.shape[1]
    y = torch.zeros(rows_out, hidden, dtype=torch.bfloat16)
    if M:
        y[:M] = ref.rank_transform(recv_x[:M], rank)
    ret_w = None
    if weights:
        ret_w = torch.zeros(rows_out, k)
        ret_w[:M] = recv_w[:M] * (1.0 + rank)
    biases = _biases(99 + rank, x.shape[0], hidden) if bias else []
    ckw = {}
    if async_:
        ckw.update(previous_event=buf.capture(), async_with_compute_stream=True, allocate_on_comm_stream=True)
    combined, combined_w, event = buf.combine(y, handle, topk_weights=ret_w, bias=tuple(biases) if bias else None,
                                              **ckw)
    if async_:
        event.current_stream_wait()
    exp_c = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda d, t: ref.rank_transform(x[t], d),
                             biases=biases, ranks_per_node=ranks_per_node)
    assert_same(combined, exp_c, "combined_x")
    if weights:
        exp_w = ref.v2_combined_weights(inputs, rank, E, lambda d, t, j: w[t, j] * (1.0 + d))
        assert_same(combined_w, exp_w, "combined_topk_weights")
    else:
        assert combined_w is None


def v2_expanded(group, deep_ep, alignment=4, base_tokens=12, hidden=256, num_experts=16, num_topk=4, T=16,
                do_cpu_sync=True, allow_multiple_reduction=True, weights=True, seed=1, cached=True):
    rank, R, SU, SO = group_info(group)
    inputs = ref.make_inputs(R, base_tokens, hidden, num_experts, num_topk, seed)
    x, idx, w = inputs[rank]
    E, k, El = num_experts, num_topk, num_experts // R
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=hidden, num_topk=k,
                                allow_multiple_reduction=allow_multiple_reduction, explicitly_destroy=True)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w if weights else None,
                                                       num_experts=E, expert_alignment=alignment, do_expand=True,
                                                       do_cpu_sync=do_cpu_sync)
    exp = ref.v2_dispatch_expanded(inputs, rank, E, alignment)
    assert recv_idx is None, "expanded dispatch returns recv_topk_idx None"
    if do_cpu_sync:
        assert recv_x.shape == (exp["total"], hidden)
        assert handle.num_expanded_tokens == exp["total"]
        assert list(handle.num_recv_tokens_per_expert_list) == [ref.align(c, alignment) for c in exp["counts"]]
    else:
        worst = ref.align(R * T * min(k, El) + (alignment - 1) * El, alignment)
        assert recv_x.shape == (worst, hidden), f"recv_x {tuple(recv_x.shape)}, worst case {worst}"
        assert list(handle.num_recv_tokens_per_expert_list) == []
    assert handle.num_unaligned_recv_tokens_per_expert.tolist() == exp["counts"]
    assert handle.psum_num_recv_tokens_per_expert.tolist() == [s + c for s, c in zip(exp["starts"], exp["counts"])]
    _check_expanded_rows(recv_x, exp, inputs, "expanded recv_x")
    if weights:
        for i, rows in enumerate(exp["per_expert"]):
            if rows:
                st = exp["starts"][i]
                want_w = torch.stack([inputs[s][2][t, j] for s, t, j in rows])
                assert_same(recv_w[st:st + len(rows)], want_w, f"expanded recv_topk_weights of local expert {i}")
    # combine: each row returns expert_e(x); padding rows hold garbage that must be ignored
    y = torch.full((recv_x.shape[0], hidden), 1e4, dtype=torch.bfloat16)
    ret_w = torch.full((recv_x.shape[0],), 1e4) if weights else None
    for i in range(El):
        st = exp["starts"][i]
        for r, (s, t, j) in enumerate(exp["per_expert"][i]):
            y[st + r] = ref.expert_transform(recv_x[st + r], rank * El + i)
            if weights:
                ret_w[st + r] = recv_w[st + r] * 2.0
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=ret_w)
    hybrid = SO > 1
    exp_c = ref.combine_rank(inputs, rank, E, lane_rows_of=lambda t, j: ref.expert_transform(x[t], int(idx[t, j])),
                             ranks_per_node=SU if hybrid else None, multiple_reduction=allow_multiple_reduction)
    assert_same(combined, exp_c, "expanded combined_x")
    if weights:
        exp_w = ref.v2_combined_weights(inputs, rank, E, lambda d, t, j: w[t, j] * 2.0)
        assert_same(combined_w, exp_w, "expanded combined_topk_weights")
    if cached and do_cpu_sync:
        x2 = ref.make_inputs(R, base_tokens, hidden, E, k, seed + 5)
        # With the shape arguments repeated, and left at their defaults (DeepEP: the handle's).
        for kwargs in (dict(do_expand=True, expert_alignment=alignment), dict()):
            rx2, ri2, _, h2, _ = buf.dispatch(x2[rank][0], handle=handle, **kwargs)
            assert h2 is handle and ri2 is None
            assert rx2.shape == (exp["total"], hidden), (tuple(rx2.shape), kwargs)
            _check_expanded_rows(rx2, exp, x2, "cached expanded recv_x", f" ({kwargs})")
    buf.destroy()
    return {"rank": rank, "total": exp["total"]}


def _check_expanded_rows(recv_x, exp, inputs, what, suffix=""):
    """The rows of every local expert's block of an expanded dispatch: the source tokens' x in the
    reference's order."""
    for i, rows in enumerate(exp["per_expert"]):
        if rows:
            st = exp["starts"][i]
            assert_same(recv_x[st:st + len(rows)], torch.stack([inputs[s][0][t] for s, t, _ in rows]),
                        f"{what} of local expert {i}{suffix}")
