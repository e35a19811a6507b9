"""Shrink mode survives failed ranks (docs/legacy.md §4), DeepEP's scenario of a simulated failure
from Python: a rank fails the first time it reaches a low-latency call (rank 1 at dispatch, rank 3
at combine, rank 5 at clean) by destroying its buffer and returning — or, in processes, rank 3 is
killed — while the others go on over the wire formats DeepEP's test runs (BF16; FP8, with
round_scale, with UE8M0 scales; with and without the receive hook; dispatching once or twice;
combining in place or not). After every call each survivor checks its mask (exactly the ranks
failed so far) and its outputs against reference.py without the failed ranks' tokens and experts
(the combine: without the experts of the ranks failed by then)."""

import os
import signal

import torch

import moe_ep
from moe_ep import deep_ep

import conftest
import reference as ref

H, E, K, CAP, N = 256, 12, 3, 8, 6
FAILS = {"dispatch": 1, "combine": 3, "clean": 5}
VARIANTS = [(fp8, rs, ue, hook) for hook in (False, True) for fp8, rs, ue in
            ((False, False, False), (True, False, False), (True, True, False), (True, True, True))]


def _kept(inputs, failed):
    """The inputs with every lane between a failed rank and another (either side) set to -1."""
    R = len(inputs)
    kept = []
    for s, (x, idx, w) in enumerate(inputs):
        owner = torch.div(idx.clamp(min=0), E // R, rounding_mode="floor")
        cut = (idx >= 0) & (torch.isin(owner, torch.tensor(sorted(failed), dtype=owner.dtype)) | (s in failed))
        kept.append((x, idx.masked_fill(cut, -1), w))
    return kept


def _mask(buf, R):
    status = torch.full((R,), -1, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    return {r for r in range(R) if int(status[r]) != 0}


def _check_slab(rank, inputs, failed, variant, recv, count, handle):
    """Counts, source infos and rows of every local expert against the reference."""
    fp8, round_scale, ue8m0, _ = variant
    expected = ref.ll_expert_tokens(_kept(inputs, failed), rank, E)
    for le, pairs in enumerate(expected):
        assert int(count[le]) == len(pairs), (rank, le, int(count[le]), len(pairs))
        for i, (s, t) in enumerate(pairs):
            assert int(handle[0][le, i]) == t, (rank, le, i)
            row = inputs[s][0][t:t + 1]
            if not fp8:
                assert torch.equal(recv[le, i].view(torch.int16), row[0].view(torch.int16)), (rank, le, i)
                continue
            q, scale_inv = ref.fp8_block_cast(row, round_scale=round_scale)
            got = recv[0][le, i].to(torch.float64).numpy()
            assert (got == q[0]).all(), (rank, le, i)
            want_scales = ref.ue8m0_pack(scale_inv)[0] if ue8m0 else scale_inv[0]
            assert torch.equal(recv[1][le, i].contiguous().view(torch.int32), want_scales.view(torch.int32)), (rank, le, i)


def _expert_outputs(rank, inputs, failed):
    """y [El, R*N, H]: each received row's expert output, from the reference's row list."""
    R = len(inputs)
    y = torch.zeros(E // R, R * CAP, H, dtype=torch.bfloat16)
    for le, pairs in enumerate(ref.ll_expert_tokens(_kept(inputs, failed), rank, E)):
        for i, (s, t) in enumerate(pairs):
            y[le, i] = ref.expert_transform(inputs[s][0][t], rank * (E // R) + le)
    return y


def _fail(buf, how):
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    buf.destroy()


def _scenario(rank, R, group, kill=()):
    """Runs the calls; returns "failed at <call>" for a failed rank, the variants run otherwise."""
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(CAP, H, R, E),
                         low_latency_mode=True, num_qps_per_rank=E // R, explicitly_destroy=True, enable_shrink=True)
    inputs = ref.make_inputs(R, N, H, E, K, seed=97)
    x, idx, w = inputs[rank]
    failed = set()

    def reach(call):  # the failure simulation: True if this rank fails here
        victim = FAILS[call]
        if victim >= R or victim in failed:
            return False
        failed.add(victim)
        if victim == rank:
            _fail(buf, "kill" if victim in kill else "destroy")
            return True
        return False

    for n, variant in enumerate(VARIANTS):
        fp8, round_scale, ue8m0, hook = variant
        if reach("dispatch"):
            return "failed at dispatch"
        for _ in range(1 + n % 2):
            recv, count, handle, event, recv_hook = buf.low_latency_dispatch(
                x, idx, CAP, E, use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0,
                async_finish=not hook, return_recv_hook=hook)
            recv_hook() if hook else event.current_stream_wait()
        assert _mask(buf, R) == failed, (rank, "dispatch", _mask(buf, R), failed)
        _check_slab(rank, inputs, failed, variant, recv, count, handle)
        y = _expert_outputs(rank, inputs, failed)
        if reach("combine"):
            return "failed at combine"
        zero_copy = n % 2 == 1
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
        combined, event, recv_hook = buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy,
                                                             async_finish=not hook, return_recv_hook=hook)
        recv_hook() if hook else event.current_stream_wait()
        assert _mask(buf, R) == failed, (rank, "combine", _mask(buf, R), failed)
        want = ref.ll_combine(_kept(inputs, failed), rank, E, lambda t, e: ref.expert_transform(x[t], e))
        assert torch.equal(combined.view(torch.int16), want.view(torch.int16)), (rank, variant)
        if reach("clean"):
            return "failed at clean"
        buf.clean_low_latency_buffer(CAP, H, E)
        assert _mask(buf, R) == failed, (rank, "clean", _mask(buf, R), failed)
    buf.destroy()
    return len(VARIANTS)


def _expected(R):
    return ["failed at " + {v: k for k, v in FAILS.items()}[r] if r in FAILS.values() else len(VARIANTS)
            for r in range(R)]


def test_deepep_scenario_on_threads():
    for ranks, nodes in ((6, 1), (6, 2)):
        got = moe_ep.LocalWorld(ranks, nodes).run(lambda g: _scenario(g.rank(), g.size(), g))
        assert got == _expected(ranks), got


def _process_scenario(rank, world, group):
    return _scenario(rank, world, group, kill=(3,))


def test_deepep_scenario_on_processes_with_a_killed_rank(shm_unchanged):
    out = conftest.run_processes(_process_scenario, 6, expect_missing=(3,), clean_exit=False,
                                 env={"MOE_EP_TIMEOUT_SECS": "60"})
    assert out[3][0] == "exit" and out[3][1] == -signal.SIGKILL, out[3]
    results = conftest.check_all_ok({r: v for r, v in out.items() if r != 3})
    assert results == [v for r, v in enumerate(_expected(6)) if r != 3], results
