"""The V1 (Buffer) low-latency scenarios: the dispatch's slabs, the combine (zero-copy, hooks, out)
and the order within an expert."""
import numpy as np
import torch

import reference as ref

from .common import assert_same, group_info
from .v1_normal import v1_buffer


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
