"""Per-rank scenarios shared by the thread (LocalWorld) and process (gloo) tests.

Each scenario runs on one rank with its group (a moe_ep.Group or a torch.distributed group),
builds every rank's inputs from a seed (tests/python/reference.py), calls moe-ep through DeepEP's
API and checks every output against the reference; it returns a small summary (plain values).
"""

import collections.abc

import numpy as np
import torch

import reference as ref


def assert_same(actual, expected, what):
    assert actual is not None, f"{what} is None"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    if actual.dtype == torch.float8_e4m3fn:  # compared as codes: float8 has no equality kernels
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    if not torch.equal(actual, expected):
        diff = (actual != expected)
        if diff.dim() > 1:
            diff = diff.reshape(diff.shape[0], -1).any(1)
        rows = torch.nonzero(diff).flatten().tolist()
        raise AssertionError(f"{what}: {len(rows)} of {actual.shape[0]} rows differ (first rows {rows[:8]})")


def group_info(group):
    """(rank, size, ranks per node) of any group argument."""
    import moe_ep
    g = moe_ep.resolve_group(group)
    return g.rank(), g.size(), g.num_scaleup, g.num_scaleout


def _fp8_pair(x, seed_rank):
    """A pass-through FP8 input: a torch.float8_e4m3fn tensor of arbitrary valid E4M3 codes, and
    FP32 scales [N, H/128]."""
    gen = torch.Generator().manual_seed(4242 + seed_rank)
    n, h = x.shape
    codes = torch.randint(0, 126, (n, h), generator=gen, dtype=torch.int64).to(torch.uint8)
    codes |= (torch.randint(0, 2, (n, h), generator=gen) * 128).to(torch.uint8)
    scales = torch.rand(n, h // 128, generator=gen) + 0.5
    return codes.view(torch.float8_e4m3fn), scales


# ---------------------------------------------------------------------------------------------
# V2 ElasticBuffer
# ---------------------------------------------------------------------------------------------

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
    if fp8:
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
    # prefix over scale-up indices of the rows received from sources s with s % SU == r
    LSU = SU if allow_hybrid_mode else R  # the logical scale-up domain
    per_su = [sum(1 for s, _ in exp["rows"] if s % LSU == r) for r in range(LSU)]
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == np.cumsum(per_su).tolist()
    meta = handle.recv_src_metadata
    own = lambda e: ref.owner(e, E, R)
    exp_meta0 = [s * T + t for s, t in exp["rows"]]
    exp_meta1 = [s * k + ref.master_lane(inputs[s][1][t], own, rank) for s, t in exp["rows"]]
    assert meta[:M, 0].tolist() == exp_meta0, "recv_src_metadata[:, 0] = src_rank * T + src_token"
    assert meta[:M, 1].tolist() == exp_meta1, "recv_src_metadata[:, 1] = src_rank * k + master lane"
    assert handle.topk_idx.tolist() == idx.tolist()
    if not fp8:
        # combine: each destination returns f(its received row); weights come back per lane
        y = torch.zeros(rows_out, hidden, dtype=torch.bfloat16)
        if M:
            y[:M] = ref.rank_transform(recv_x[:M], rank)
        ret_w = None
        if weights:
            ret_w = torch.zeros(rows_out, k)
            ret_w[:M] = recv_w[:M] * (1.0 + rank)
        biases = []
        if bias:
            gen = torch.Generator().manual_seed(99 + rank)
            biases = [torch.randn(x.shape[0], hidden, generator=gen).to(torch.bfloat16) for _ in range(2)]
        ckw = {}
        if async_:
            ckw.update(previous_event=buf.capture(), async_with_compute_stream=True, allocate_on_comm_stream=True)
        combined, combined_w, event = buf.combine(y, handle, topk_weights=ret_w, bias=tuple(biases) if bias else None,
                                                  **ckw)
        if async_:
            event.current_stream_wait()
        exp_c = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda d, t: ref.rank_transform(x[t], d),
                                 biases=biases, ranks_per_node=SU if hybrid else None)
        assert_same(combined, exp_c, "combined_x")
        if weights:
            exp_w = ref.v2_combined_weights(inputs, rank, E, lambda d, t, j: w[t, j] * (1.0 + d))
            assert_same(combined_w, exp_w, "combined_topk_weights")
        else:
            assert combined_w is None
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
    for i in range(El):
        st = exp["starts"][i]
        rows = exp["per_expert"][i]
        if not rows:
            continue
        want_x = torch.stack([inputs[s][0][t] for s, t, _ in rows])
        assert_same(recv_x[st:st + len(rows)], want_x, f"expanded recv_x of local expert {i}")
        if weights:
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
            for i in range(El):
                st = exp["starts"][i]
                rows = exp["per_expert"][i]
                if rows:
                    assert_same(rx2[st:st + len(rows)], torch.stack([x2[s][0][t] for s, t, _ in rows]),
                                f"cached expanded recv_x of local expert {i} ({kwargs})")
    buf.destroy()
    return {"rank": rank, "total": exp["total"]}


# ---------------------------------------------------------------------------------------------
# V1 Buffer, normal mode
# ---------------------------------------------------------------------------------------------

def v1_buffer(group, deep_ep, low_latency_mode=False, hidden=256, num_experts=16, cap=16):
    rank, R, SU, SO = group_info(group)
    Buffer = deep_ep.Buffer
    nvl = max(c.get_nvl_buffer_size_hint(hidden * 2, R) for c in (Buffer.get_dispatch_config(R),
                                                                   Buffer.get_combine_config(R)))
    rdma = 0
    if SO > 1:
        rdma = 64 << 20
    if low_latency_mode:
        rdma = max(rdma, Buffer.get_low_latency_rdma_size_hint(cap, hidden, R, num_experts))
    return Buffer(group, nvl, rdma, low_latency_mode=low_latency_mode, num_qps_per_rank=max(1, num_experts // R),
                  explicitly_destroy=True)


def v1_normal(group, deep_ep, base_tokens=12, hidden=256, num_experts=16, num_topk=4, alignment=1, fp8=False,
              num_worst_tokens=0, bias=True, seed=2, cached=True, async_=False, buf=None):
    rank, R, SU, SO = group_info(group)
    inputs = ref.make_inputs(R, base_tokens, hidden, num_experts, num_topk, seed)
    x, idx, w = inputs[rank]
    E, k = num_experts, num_topk
    own_buf = buf is None
    buf = buf or v1_buffer(group, deep_ep, hidden=hidden, num_experts=E)
    lkw = {}
    if async_:
        lkw = dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True)
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E, **lkw)
    if async_:
        ev.current_stream_wait()
    e_rank, e_rdma, e_expert, e_in = ref.v1_layout(idx, E, R, SU if SO > 1 else None)
    assert_same(per_rank, e_rank, "num_tokens_per_rank")
    assert_same(per_expert, e_expert, "num_tokens_per_expert")
    assert_same(in_rank, e_in, "is_token_in_rank")
    if SO > 1:
        assert_same(per_rdma, e_rdma, "num_tokens_per_rdma_rank")
    pairs = [_fp8_pair(inputs[s][0], s) for s in range(R)] if fp8 else None
    xin = pairs[rank] if fp8 else x
    dkw = {}
    if async_:
        dkw = dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
        xin, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=alignment,
        num_worst_tokens=num_worst_tokens, **dkw)
    if async_:
        ev.current_stream_wait()
    exp = ref.v1_dispatch(inputs, rank, E, alignment, payload=(lambda s: pairs[s][0]) if fp8 else None)
    M = len(exp["rows"])
    rows_out = num_worst_tokens or M
    if fp8:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2
        recv_x, recv_sf = recv_x
        exp_sf = torch.stack([pairs[s][1][t] for s, t in exp["rows"]])
        assert_same(recv_sf[:M].contiguous(), exp_sf, "recv_x_scales")
    assert recv_x.shape == (rows_out, hidden)
    assert_same(recv_x[:M], exp["recv_x"], "recv_x")
    assert_same(recv_idx[:M], exp["recv_topk_idx"], "recv_topk_idx")
    assert_same(recv_w[:M], exp["recv_topk_weights"], "recv_topk_weights (0 where the id is -1)")
    if num_worst_tokens:
        assert counts == [], "num_recv_tokens_per_expert_list is empty with num_worst_tokens"
        assert recv_idx.shape[0] == num_worst_tokens and bool((recv_idx[M:] == -1).all())
    else:
        assert list(counts) == exp["num_recv_tokens_per_expert_list"]
    # A real tuple; an asynchronous dispatch's handle is a sequence read once its event completed.
    assert isinstance(handle, tuple) or (async_ and isinstance(handle, collections.abc.Sequence))
    if SO == 1:
        assert len(handle) == 6
        rank_prefix, _, _, recv_src_idx, h_in_rank, send_head = handle
        assert recv_src_idx.tolist()[:M] == [t for _, t in exp["rows"]], "recv_src_idx"
        col = np.cumsum([sum(1 for s, _ in exp["rows"] if s == src) for src in range(R)]).tolist()
        assert rank_prefix[:, rank].tolist() == col, "rank_prefix_matrix[:, rank]"
        assert_same(h_in_rank, e_in, "handle is_token_in_rank")
    else:
        assert len(handle) == 10
    # combine: plain sum (no weights applied); weight rows come back summed
    y = torch.zeros(rows_out, hidden, dtype=torch.bfloat16)
    y[:M] = ref.rank_transform(recv_x[:M], rank) if not fp8 else ref.rank_transform(exp_bf16_rows(inputs, exp), rank)
    ret_w = torch.zeros(rows_out, k)
    ret_w[:M] = recv_w[:M] + (rank + 1) / 4.0
    biases = []
    if bias:
        gen = torch.Generator().manual_seed(7 + rank)
        biases = [torch.randn(x.shape[0], hidden, generator=gen).to(torch.bfloat16) for _ in range(2)]
    ckw = {}
    if async_:
        ckw = dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True)
    combined, combined_w, ev = buf.combine(y, handle, topk_weights=ret_w, bias=tuple(biases) if bias else None, **ckw)
    if async_:
        ev.current_stream_wait()
    exp_c = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda d, t: ref.rank_transform(x[t], d), biases=biases,
                             ranks_per_node=SU if SO > 1 else None)
    assert_same(combined, exp_c, "combined_x")

    def returned_row(d, t):
        row = torch.tensor([float(wj) if ref.owner(int(e), E, R) == d else 0.0
                            for wj, e in zip(w[t].tolist(), idx[t].tolist())], dtype=torch.float32)
        row = torch.where(idx[t] >= 0, row, torch.zeros_like(row))
        return row + (d + 1) / 4.0

    exp_w = ref.v1_combined_weights(inputs, rank, E, returned_row, ranks_per_node=SU if SO > 1 else None)
    assert_same(combined_w, exp_w, "combined_topk_weights")
    if cached and not num_worst_tokens:
        inputs2 = ref.make_inputs(R, base_tokens, hidden, E, k, seed + 3)
        pairs2 = [_fp8_pair(inputs2[s][0], 50 + s) for s in range(R)] if fp8 else None
        out = buf.dispatch(pairs2[rank] if fp8 else inputs2[rank][0], handle=handle)
        assert len(out) == 6 and out[1:5] == (None, None, None, None), "cached dispatch returns (recv_x, None x4, event)"
        rx2 = out[0][0] if fp8 else out[0]
        payload = (lambda s: pairs2[s][0]) if fp8 else (lambda s: inputs2[s][0])
        assert_same(rx2[:M], torch.stack([payload(s)[t] for s, t in exp["rows"]]), "cached dispatch recv_x")
    if own_buf:
        buf.destroy()
    return {"rank": rank, "M": M}


def exp_bf16_rows(inputs, exp):
    return torch.stack([inputs[s][0][t] for s, t in exp["rows"]])


# ---------------------------------------------------------------------------------------------
# V1 Buffer, low-latency mode
# ---------------------------------------------------------------------------------------------

def check_ll_dispatch(inputs, rank, E, cap, recv_x, count, handle, fp8=False, round_scale=False, use_ue8m0=False):
    """Checks a low-latency dispatch's outputs; returns per local expert the (src, token) of each
    slab row (in slab order) for the combine."""
    R = len(inputs)
    El = E // R
    H = inputs[0][0].shape[1]
    per = ref.ll_expert_tokens(inputs, rank, E)
    src_info, layout_range = handle[0], handle[1]
    assert tuple(handle[2:]) == (cap, H, E), "handle = (src_info, layout_range, N, H, E)"
    assert src_info.shape == (El, R * cap) and src_info.dtype == torch.int32
    assert layout_range.shape == (El, R) and layout_range.dtype == torch.int64
    assert count.dtype == torch.int32 and count.tolist() == [len(p) for p in per], "packed_recv_count"
    if fp8:
        data, scales = recv_x
        assert data.shape == (El, R * cap, H) and data.dtype == torch.float8_e4m3fn
        if use_ue8m0:
            assert scales.dtype == torch.int32 and scales.shape == (El, R * cap, (H + 511) // 512)
        else:
            assert scales.dtype == torch.float32 and scales.shape == (El, R * cap, H // 128)
        assert scales.stride(1) == 1, "scales have token stride 1 (column-major for TMA)"
    else:
        assert recv_x.shape == (El, R * cap, H) and recv_x.dtype == torch.bfloat16
    slab_rows = []
    for i in range(El):
        n = len(per[i])
        covered = []
        got = []
        for s in range(R):
            v = int(layout_range[i, s])
            begin, cnt = v >> 32, v & 0xFFFFFFFF
            want = [t for ss, t in per[i] if ss == s]
            assert cnt == len(want), f"layout_range[{i}, {s}] count {cnt}, expected {len(want)}"
            toks = src_info[i, begin:begin + cnt].tolist()
            assert sorted(toks) == want, f"expert {i}, source {s}: tokens {toks}, expected {want}"
            covered.extend(range(begin, begin + cnt))
            got.extend((s, t, begin + r) for r, t in enumerate(toks))
        assert sorted(covered) == list(range(n)), f"expert {i}: the source blocks do not tile rows [0, {n})"
        rows = [None] * n
        for s, t, row in got:
            rows[row] = (s, t)
        slab_rows.append(rows)
        if not n:
            continue
        xs = torch.stack([inputs[s][0][t] for s, t in rows])
        if not fp8:
            assert_same(recv_x[i, :n], xs, f"low-latency recv_x of local expert {i}")
        else:
            q, scale_inv = ref.fp8_block_cast(xs, round_scale=round_scale)
            got_q = ref.e4m3_decode(data[i, :n].contiguous().view(torch.uint8).numpy())
            bad = ~((got_q == q) | (np.isnan(got_q) & np.isnan(q)))
            assert not bad.any(), (f"FP8 payload of local expert {i}: {int(bad.sum())} of {bad.size} values differ "
                                   f"from E4M3(x * 448 / amax); e.g. got {got_q[bad][:4]}, expected {q[bad][:4]}")
            if use_ue8m0:
                assert_same(scales[i, :n].contiguous(), ref.ue8m0_pack(scale_inv), f"UE8M0 scales of expert {i}")
            else:
                assert_same(scales[i, :n].contiguous(), scale_inv, f"scales of local expert {i}")
    return slab_rows


def v1_low_latency(group, deep_ep, base_tokens=12, hidden=256, num_experts=16, num_topk=4, cap=16, fp8=False,
                   round_scale=False, use_ue8m0=False, return_recv_hook=False, async_finish=False, zero_copy=False,
                   combine_hook=False, use_out=False, seed=3, rounds=1, buf=None, zero_copy_x="buffer"):
    """zero_copy_x (with zero_copy): "buffer" passes the combine buffer as x; "shape" passes another
    tensor of its shape filled with NaN (DeepEP reads the buffer; x gives only the shape)."""
    rank, R, SU, SO = group_info(group)
    E, k = num_experts, num_topk
    El = E // R
    own_buf = buf is None
    buf = buf or v1_buffer(group, deep_ep, low_latency_mode=True, hidden=hidden, num_experts=E, cap=cap)
    for rnd in range(rounds):
        inputs = ref.make_inputs(R, base_tokens, hidden, E, k, seed + 11 * rnd)
        x, idx, w = inputs[rank]
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(
            x, idx, cap, E, use_fp8=fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
            return_recv_hook=return_recv_hook)
        if return_recv_hook:
            assert callable(hook)
            hook()
        else:
            assert hook is None
        if async_finish:
            event.current_stream_wait()
        slab_rows = check_ll_dispatch(inputs, rank, E, cap, recv_x, count, handle, fp8, round_scale, use_ue8m0)
        y = torch.zeros(El, R * cap, hidden, dtype=torch.bfloat16)
        for i in range(El):
            for r, (s, t) in enumerate(slab_rows[i]):
                y[i, r] = ref.expert_transform(inputs[s][0][t], rank * El + i)
        if zero_copy:
            target = buf.get_next_low_latency_combine_buffer(handle)
            m = hidden + 2 * (hidden // 128)
            assert target.shape == (El, R * cap, hidden) and target.dtype == torch.bfloat16
            assert target.stride() == (R * cap * m, m, 1), f"combine buffer strides {target.stride()}"
            target.copy_(y)
            y_in = target if zero_copy_x == "buffer" else torch.full_like(y, float("nan"))
        else:
            y_in = y
        out = torch.full((x.shape[0], hidden), 3.0, dtype=torch.bfloat16) if use_out else None
        combined, event, chook = buf.low_latency_combine(y_in, idx, w, handle, zero_copy=zero_copy,
                                                         async_finish=async_finish, return_recv_hook=combine_hook,
                                                         out=out)
        if combine_hook:
            chook()
        if async_finish:
            event.current_stream_wait()
        exp = ref.ll_combine(inputs, rank, E, lambda t, e: ref.expert_transform(x[t], e))
        assert_same(combined, exp, "low-latency combined_x")
        if use_out:
            assert_same(out, exp, "low-latency combine's out")
    if own_buf:
        buf.destroy()
    return {"rank": rank}


def ll_order_is_source_then_token(group, deep_ep, base_tokens=12, hidden=256, num_experts=16, num_topk=4, cap=16):
    """moe-ep's documented deterministic order within an expert (docs/legacy.md §4)."""
    rank, R, SU, SO = group_info(group)
    inputs = ref.make_inputs(R, base_tokens, hidden, num_experts, num_topk, 21)
    buf = v1_buffer(group, deep_ep, low_latency_mode=True, hidden=hidden, num_experts=num_experts, cap=cap)
    x, idx, _ = inputs[rank]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, cap, num_experts, use_fp8=False)
    per = ref.ll_expert_tokens(inputs, rank, num_experts)
    for i, p in enumerate(per):
        if p:
            assert_same(recv_x[i, :len(p)], torch.stack([inputs[s][0][t] for s, t in p]), f"order of expert {i}")
            assert handle[0][i, :len(p)].tolist() == [t for _, t in p]
    buf.destroy()
    return True
