"""The V1 (Buffer) normal-mode scenario: the layout, the dispatch with its handle, the combine and a
cached dispatch; and the Buffer every V1 scenario uses."""
import collections.abc

import numpy as np
import torch

import reference as ref

from .common import _biases, _fp8_pair, assert_same, group_info


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
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E, **_v1_async(buf, async_))
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
    recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
        xin, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=alignment,
        num_worst_tokens=num_worst_tokens, **_v1_async(buf, async_))
    if async_:
        ev.current_stream_wait()
    exp = ref.v1_dispatch(inputs, rank, E, alignment, payload=(lambda s: pairs[s][0]) if fp8 else None)
    M = len(exp["rows"])
    rows_out = num_worst_tokens or M
    recv_x = _check_v1_received(recv_x, recv_idx, recv_w, counts, exp, pairs, rows_out, hidden, num_worst_tokens)
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
    rows_in = recv_x[:M] if not fp8 else exp_bf16_rows(inputs, exp)
    _combine_v1(buf, handle, rows_in, recv_w, inputs, rank, E, rows_out, bias, async_, SU if SO > 1 else None)
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


def _v1_async(buf, async_):
    """The keyword arguments of an asynchronous V1 call (none for a synchronous one)."""
    return dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True) if async_ else {}


def _check_v1_received(recv_x, recv_idx, recv_w, counts, exp, pairs, rows_out, hidden, num_worst_tokens):
    """A V1 normal dispatch's rows, scales (FP8), ids, weights and expert counts against the
    reference; returns recv_x without its scales."""
    M = len(exp["rows"])
    if pairs:
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
    return recv_x


def _combine_v1(buf, handle, rows_in, recv_w, inputs, rank, E, rows_out, bias, async_, ranks_per_node):
    """Combine after a V1 normal dispatch of `rows_in` (BF16): a plain sum (no weights applied) of
    each rank's f(row); the weight rows come back summed."""
    x, idx, w = inputs[rank]
    R, M, hidden, k = len(inputs), rows_in.shape[0], x.shape[1], w.shape[1]
    y = torch.zeros(rows_out, hidden, dtype=torch.bfloat16)
    y[:M] = ref.rank_transform(rows_in, rank)
    ret_w = torch.zeros(rows_out, k)
    ret_w[:M] = recv_w[:M] + (rank + 1) / 4.0
    biases = _biases(7 + rank, x.shape[0], hidden) if bias else []
    combined, combined_w, ev = buf.combine(y, handle, topk_weights=ret_w, bias=tuple(biases) if bias else None,
                                           **_v1_async(buf, async_))
    if async_:
        ev.current_stream_wait()
    exp_c = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda d, t: ref.rank_transform(x[t], d), biases=biases,
                             ranks_per_node=ranks_per_node)
    assert_same(combined, exp_c, "combined_x")

    def returned_row(d, t):
        row = torch.tensor([float(wj) if ref.owner(int(e), E, R) == d else 0.0
                            for wj, e in zip(w[t].tolist(), idx[t].tolist())], dtype=torch.float32)
        row = torch.where(idx[t] >= 0, row, torch.zeros_like(row))
        return row + (d + 1) / 4.0

    exp_w = ref.v1_combined_weights(inputs, rank, E, returned_row, ranks_per_node=ranks_per_node)
    assert_same(combined_w, exp_w, "combined_topk_weights")


def exp_bf16_rows(inputs, exp):
    return torch.stack([inputs[s][0][t] for s, t in exp["rows"]])
