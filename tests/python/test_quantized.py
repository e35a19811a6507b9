"""The quantized low-latency wire formats from Python (hybrid-ep's signature): NVFP4 dispatch
checked through DeepEP's permuted views against the numpy cast of reference.py, the 7-tuple's
weights and ranks, the argument rules, the FP8 dispatch's scales against DeepEP's formula
written out here, and the LogFMT combine within DeepEP's tolerance of the unquantized combine."""

import numpy as np
import pytest
import torch

import moe_ep
from moe_ep.deep_ep import hybrid_ep

import reference as ref

H, E, K, CAP, N = 512, 16, 4, 16, 12


def _buffer(g):
    return hybrid_ep.Buffer(g, 0, hybrid_ep.Buffer.get_low_latency_rdma_size_hint(CAP, H, g.size(), E),
                            low_latency_mode=True, num_qps_per_rank=E // g.size(), explicitly_destroy=True)


@pytest.mark.parametrize("ranks,nodes", [(2, 1), (4, 2)])
def test_nvfp4_dispatch_views_and_values(ranks, nodes):
    gs = 448.0 * 6 / 3.0

    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=57)
        x, idx, w = inputs[g.rank()]
        buf = _buffer(g)
        (values, scales), count, recv_w, rank_info, handle, _, _ = buf.low_latency_dispatch(
            x, idx, CAP, E, topk_weights=w, x_global_scale=torch.tensor(gs, dtype=torch.float32), use_fp8=False,
            use_nvfp4=True)
        L, RN = E // g.size(), g.size() * CAP
        rm, rk = (RN + 127) // 128, H // 64
        assert values.dtype == torch.uint8 and tuple(values.shape) == (RN, H // 2, L)
        assert tuple(scales.shape) == (32, 4, rm, 4, rk, L)
        sc = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
        expected = ref.ll_expert_tokens(inputs, g.rank(), E)
        for le in range(L):
            assert int(count[le]) == len(expected[le])
            for row, (s, t) in enumerate(expected[le]):
                packed, codes = ref.nvfp4_cast(inputs[s][0][t], gs)
                assert np.array_equal(values[row, :, le].numpy(), packed), (le, row)
                for j in range(H // 16):  # DeepEP's logical index of (row, block j)
                    assert int(sc[row % 32, (row % 128) // 32, row // 128, j % 4, j // 4, le]) == int(codes[j])
                assert int(rank_info[le, row]) == s
                lane = (inputs[s][1][t] == g.rank() * L + le).nonzero()[0, 0]
                assert float(recv_w[le, row]) == float(inputs[s][2][t][lane])
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(ranks, nodes).run(fn) == [True] * ranks


def test_nvfp4_argument_rules():
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=3)
        x, idx, _ = inputs[g.rank()]
        buf = _buffer(g)
        scalar = torch.tensor(1.0)
        with pytest.raises(moe_ep.InvalidArgument, match="use_fp8 = true and use_nvfp4 = true"):
            buf.low_latency_dispatch(x, idx, CAP, E, use_nvfp4=True, x_global_scale=scalar)
        with pytest.raises(moe_ep.InvalidArgument, match="requires x_global_scale"):
            buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False, use_nvfp4=True)
        with pytest.raises(moe_ep.InvalidArgument, match="float32 scalar"):
            buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False, use_nvfp4=True, x_global_scale=torch.ones(2))
        with pytest.raises((moe_ep.InvalidArgument, TypeError), match="x_global_scale"):
            buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False, use_nvfp4=True,
                                     x_global_scale=torch.tensor(1.0, dtype=torch.float64))
        with pytest.raises(moe_ep.InvalidArgument, match="x_global_scale = -1 must be a positive finite number"):
            buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False, use_nvfp4=True, x_global_scale=torch.tensor(-1.0))
        with pytest.raises(moe_ep.InvalidArgument, match="use_ue8m0_for_sf = true requires use_nvfp4"):
            buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False, use_ue8m0_for_sf=True)
        # UE8M0 scales need no global scale; the buffer works after the refusals
        (values, scales), count, _, _, _ = buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False, use_nvfp4=True,
                                                                  use_ue8m0_for_sf=True)
        assert scales.dtype == torch.int32 and values.shape[1] == H // 2
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def _spread(inputs):
    """The inputs with each 128-channel block scaled by its own power of two in 2^-20 .. 2^19 (exact)."""
    out = []
    for r, (x, idx, w) in enumerate(inputs):
        t, b = np.meshgrid(np.arange(x.shape[0]), np.arange(H // 128), indexing="ij")
        e = torch.from_numpy(((3 * t + 7 * b + r) % 40 - 20).astype(np.float32))
        out.append(((x.float().view(x.shape[0], -1, 128) * torch.exp2(e)[:, :, None]).view(x.shape)
                    .to(torch.bfloat16), idx, w))
    return out


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_dispatch_scales_are_amax_times_the_float_reciprocal(round_scale, use_ue8m0):
    def fn(g):
        inputs = _spread(ref.make_inputs(g.size(), N, H, E, K, seed=41))
        x, idx, _ = inputs[g.rank()]
        buf = _buffer(g)
        (_, scales), count, _, _, _ = buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=True, round_scale=round_scale,
                                                               use_ue8m0=use_ue8m0)
        differ = 0
        for le, rows in enumerate(ref.ll_expert_tokens(inputs, g.rank(), E)):
            assert int(count[le]) == len(rows)
            for row, (s, t) in enumerate(rows):
                blocks = inputs[s][0][t].float().numpy().reshape(-1, 128)
                amax = np.maximum(np.abs(blocks).max(axis=1), np.float32(1e-4)).astype(np.float32)
                product = (amax * (np.float32(1.0) / np.float32(448.0))).astype(np.float32)  # DeepEP's kernel
                differ += int(((amax / np.float32(448.0)).astype(np.float32) != product).sum())
                mant, exp = np.frexp(product)
                e = np.where(mant == 0.5, exp - 1, exp)  # ceil(log2(product))
                if use_ue8m0:
                    got = scales[le, row].contiguous().numpy().view(np.uint8)[:H // 128].astype(np.int64)
                    assert got.tolist() == (e + 127).tolist(), (le, row)
                else:
                    want = np.ldexp(np.float32(1.0), e).astype(np.float32) if round_scale else product
                    got = scales[le, row].contiguous().numpy()
                    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (le, row)
        assert round_scale or differ > 0  # amax / 448 would not pass
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


@pytest.mark.parametrize("ranks,nodes", [(4, 1), (4, 2)])
def test_logfmt_combine_within_deepep_tolerance(ranks, nodes):
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=91)
        x, idx, w = inputs[g.rank()]
        buf = _buffer(g)

        def round_trip(use_logfmt):
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False)
            # expert outputs below 1 in magnitude: LogFMT compresses them
            y = (recv.to(torch.float32) * 0.125).to(torch.bfloat16)
            return buf.low_latency_combine(y, idx, w, handle, use_logfmt=use_logfmt)[0]

        exact, logfmt, again = round_trip(False), round_trip(True), round_trip(True)
        assert torch.equal(logfmt.view(torch.int16), again.view(torch.int16))  # reproducible
        if x.shape[0] > 0:
            assert not torch.equal(logfmt.view(torch.int16), exact.view(torch.int16))  # it did quantize
            assert ref.calc_diff(logfmt.float(), exact.float()) < 9e-4
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False)
        with pytest.raises(moe_ep.InvalidArgument, match="use_logfmt.*zero_copy"):
            buf.low_latency_combine(buf.get_next_low_latency_combine_buffer(handle), idx, w, handle, use_logfmt=True,
                                    zero_copy=True)
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(ranks, nodes).run(fn) == [True] * ranks


@pytest.mark.parametrize("nodes", [1, 2])
def test_dispatcher_nvfp4_same_slab_on_both_generations(nodes):
    gs = 448.0 * 6 / 4.0
    slabs = {}
    for use_v2 in (False, True):
        def fn(g):
            inputs = ref.make_inputs(g.size(), N, H, E, K, seed=23)
            x, idx, w = inputs[g.rank()]
            cache = moe_ep.BufferCache(g)
            d = moe_ep.TokenDispatcher(cache, H, E, K, use_v2=use_v2, mode="low_latency",
                                       num_max_dispatch_tokens_per_rank=CAP, dispatch_dtype="nvfp4",
                                       provider_path="cpu", nvfp4_global_scale=gs)
            out = d.dispatch(x, idx, w, kind="decode")
            values, scales = out.hidden_states, out.hidden_states_scale
            sc = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
            expected = ref.ll_expert_tokens(inputs, g.rank(), E)
            for le, rows in enumerate(expected):
                assert int(out.masked_m[le]) == len(rows)
                for row, (s, t) in enumerate(rows):
                    packed, codes = ref.nvfp4_cast(inputs[s][0][t], gs)
                    assert np.array_equal(values[row, :, le].numpy(), packed)
                    assert [int(sc[row % 32, (row % 128) // 32, row // 128, j % 4, j // 4, le]) for j in range(H // 16)] \
                        == codes.tolist()
            y = torch.zeros(E // g.size(), g.size() * CAP, H, dtype=torch.bfloat16)
            d.combine(y)
            cache.destroy()
            return (tuple(values.shape), tuple(values.stride()), tuple(scales.shape), tuple(scales.stride()),
                    sc.contiguous().numpy().tobytes(), out.masked_m.tolist())
        slabs[use_v2] = moe_ep.LocalWorld(4, nodes).run(fn)
    assert slabs[False] == slabs[True]
