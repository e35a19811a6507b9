"""The rest of the package's public surface: hybrid-ep's low-latency signature and its 7-tuple,
moe-ep memory for inputs, the group's own all-gather, barriers (and the error of each way a peer
can fail to arrive), events and handle helpers, and the measurements the benchmark reads (the
allocator's counters). Expected values come from reference.py or from the inputs themselves."""

import inspect
import os
import threading

import pytest
import torch

import moe_ep
from moe_ep import deep_ep
from moe_ep.deep_ep import hybrid_ep

import reference as ref

H, E, K, CAP, N = 256, 16, 4, 16, 12

# hybrid-ep's (94a9f8f) low_latency_dispatch, as deepep-python-api.md §1.4 lists it.
HYBRID_LL_DISPATCH = [
    ("self", inspect.Parameter.empty), ("x", inspect.Parameter.empty), ("topk_idx", inspect.Parameter.empty),
    ("num_max_dispatch_tokens_per_rank", inspect.Parameter.empty), ("num_experts", inspect.Parameter.empty),
    ("topk_weights", None), ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
    ("x_global_scale", None), ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False), ("use_nvfp4", False),
    ("use_ue8m0_for_sf", False), ("async_finish", False), ("return_recv_hook", False)]
HYBRID_LL_COMBINE_TAIL = [("out", None), ("combine_wait_recv_cost_stats", None), ("overlap", False),
                          ("src_signals", None), ("src_signal_expect_value", 0)]


def params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_hybrid_ep_signatures():
    assert params(hybrid_ep.Buffer.low_latency_dispatch) == HYBRID_LL_DISPATCH
    assert params(hybrid_ep.Buffer.low_latency_combine)[-len(HYBRID_LL_COMBINE_TAIL):] == HYBRID_LL_COMBINE_TAIL


def _hybrid_buffer(g):
    return hybrid_ep.Buffer(g, 0, hybrid_ep.Buffer.get_low_latency_rdma_size_hint(CAP, H, g.size(), E),
                            low_latency_mode=True, num_qps_per_rank=E // g.size(), explicitly_destroy=True)


@pytest.mark.parametrize("ranks,nodes", [(2, 1), (4, 1), (4, 2)])
def test_hybrid_ep_seven_tuple(ranks, nodes):
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=41)
        x, idx, w = inputs[g.rank()]
        buf = _hybrid_buffer(g)
        recv_x, count, recv_w, rank_info, handle, event, hook = buf.low_latency_dispatch(
            x, idx, CAP, E, topk_weights=w, use_fp8=False)
        El = E // g.size()
        expected = ref.ll_expert_tokens(inputs, g.rank(), E)
        assert recv_w.dtype == torch.float32 and rank_info.dtype == torch.int32
        assert recv_w.shape == rank_info.shape == (El, g.size() * CAP)
        for le in range(El):
            m = int(count[le])
            assert m == len(expected[le])
            # each valid row: the weight its source token gave this expert, and the source rank
            got = sorted((int(rank_info[le, i]), int(handle[0][le, i]), float(recv_w[le, i])) for i in range(m))
            want = sorted((s, t, float(inputs[s][2][t][(inputs[s][1][t] == g.rank() * El + le).nonzero()[0, 0]]))
                          for s, t in expected[le])
            assert got == want, f"expert {le}"
            assert bool((rank_info[le, m:] == -1).all()) and bool((recv_w[le, m:] == 0).all())
        # without topk_weights: main's 5-tuple
        assert len(buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False)) == 5
        # NVFP4 replaces FP8: asking for both (use_fp8 defaults to True) is refused
        with pytest.raises(moe_ep.InvalidArgument, match="use_fp8.*use_nvfp4"):
            buf.low_latency_dispatch(x, idx, CAP, E, use_nvfp4=True, x_global_scale=torch.tensor(1.0))
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(ranks, nodes).run(fn) == [True] * ranks


def test_group_all_gather_bytes():
    def fn(g):
        mine = bytes([g.rank()]) * (g.rank() + 1)
        return g.all_gather_bytes(mine)
    out = moe_ep.LocalWorld(3).run(fn)
    want = [bytes([r]) * (r + 1) for r in range(3)]
    assert out == [want] * 3


def test_comm_stream_is_the_cpu_stream():
    """Host buffers run every call in call order on the host: their communication stream is torch's
    CPU stream, which `with torch.cpu.stream(...)` accepts."""
    def fn(g):
        v2 = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=8, hidden=H, num_topk=K)
        v1 = deep_ep.Buffer(g, num_nvl_bytes=1 << 20)
        streams = [v2.get_comm_stream(), v1.get_comm_stream()]
        with torch.cpu.stream(streams[0]):
            pass
        return all(isinstance(s, torch.cpu.Stream) for s in streams)
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_moe_ep_memory_tensors():
    z = moe_ep.zeros(3, 5, dtype=torch.float32)
    assert z.shape == (3, 5) and z.dtype == torch.float32 and bool((z == 0).all())
    e = moe_ep.empty((2, 4), dtype=torch.int64)
    assert e.shape == (2, 4) and e.dtype == torch.int64 and e.is_contiguous()
    like = moe_ep.empty_like(torch.zeros(7, dtype=torch.bfloat16))
    assert like.shape == (7,) and like.dtype == torch.bfloat16
    assert like.data_ptr() % 64 == 0
    with pytest.raises(TypeError, match="dtype"):
        moe_ep.empty(3, dtype=torch.float64)


def _second_barrier(g, timeout, rank1):
    """Every rank passes one barrier; then rank 1 returns rank1(its buffer) instead of entering the
    second one, which rank 0 enters. Returns rank 0's error as (type name, is a TimeoutError,
    ranks, message)."""
    buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=8, hidden=H, num_topk=K, num_cpu_timeout_secs=timeout)
    buf.barrier()
    if g.rank() == 1:
        return rank1(buf)
    try:
        buf.barrier()
        return "passed"
    except moe_ep.PeerError as e:
        return (type(e).__name__, isinstance(e, moe_ep.TimeoutError), list(e.ranks), str(e))


def test_barrier_names_a_rank_that_left():
    # Rank 1's thread returns (its buffer kept alive in its result): rank 0 raises PeerError naming
    # it at once (docs/architecture.md, "Failures never hang"), not the TimeoutError of 300 s.
    out = moe_ep.LocalWorld(2).run(lambda g: _second_barrier(g, 300.0, lambda buf: buf))
    name, is_timeout, ranks, msg = out[0]
    assert (name, is_timeout, ranks) == ("PeerError", False, [1]), out
    assert "ranks [1] left the group instead of arriving; rank 1 returned from its rank function" in msg, msg


def test_barrier_against_a_destruction_names_the_rank():
    # Rank 1 drops its buffer instead: its destruction meets rank 0's barrier in the agreement, and
    # rank 0 raises PeerError naming the operation and who holds which (docs/semantics.md).
    out = moe_ep.LocalWorld(2).run(lambda g: _second_barrier(g, 300.0, lambda buf: "dropped"))
    assert out[1] == "dropped"
    name, is_timeout, ranks, msg = out[0]
    assert (name, is_timeout, ranks) == ("PeerError", False, [1]), out
    assert "ranks disagree on the operation: barrier on rank [0], destruction on rank [1]" in msg, msg


def test_barrier_names_a_rank_that_never_arrives():
    # Rank 1 stays in the group (it returns only once rank 0 has its error) but never arrives:
    # rank 0 raises TimeoutError naming it after num_cpu_timeout_secs.
    rank0_done = threading.Event()

    def fn(g):
        try:
            return _second_barrier(g, 1.0, lambda buf: "stayed" if rank0_done.wait(600) else "rank 0 never finished")
        finally:
            if g.rank() == 0:
                rank0_done.set()
    out = moe_ep.LocalWorld(2).run(fn)
    assert out[1] == "stayed"
    name, is_timeout, ranks, msg = out[0]
    assert (name, is_timeout, ranks) == ("TimeoutError", True, [1]), out


def test_allocator_stats_count_maps_and_reuse():
    # One block larger than everything cached cannot be served from the cache: one mmap of its
    # size rounded up to 2 MiB; released, it is cached; the same request again reuses it.
    def stats():
        return moe_ep._C.allocator_stats()
    before = stats()
    assert set(before) == {"mapped_bytes", "cached_bytes", "num_maps"}
    nbytes = before["cached_bytes"] + (3 << 20) + 4096
    rounded = (nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    if before["cached_bytes"] + rounded > int(os.environ.get("MOE_EP_ALLOCATOR_CACHE_BYTES", 1 << 36)):
        pytest.skip("MOE_EP_ALLOCATOR_CACHE_BYTES leaves no room to cache the block")
    block = moe_ep.empty(nbytes, dtype=torch.uint8)
    mapped = stats()
    assert mapped["num_maps"] == before["num_maps"] + 1
    assert mapped["mapped_bytes"] == before["mapped_bytes"] + rounded
    assert mapped["cached_bytes"] == before["cached_bytes"]
    del block
    released = stats()
    assert released["cached_bytes"] == before["cached_bytes"] + rounded
    assert released["mapped_bytes"] == mapped["mapped_bytes"]
    again = moe_ep.empty(nbytes, dtype=torch.uint8)
    reused = stats()
    assert reused["num_maps"] == mapped["num_maps"]
    assert reused["cached_bytes"] == before["cached_bytes"]
    del again


def test_handle_helpers_and_measurements():
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=43)
        x, idx, w = inputs[g.rank()]
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=16, hidden=H, num_topk=K)
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        native = moe_ep._C.last_native_seconds()
        assert native > 0
        # the order is already deterministic: the sort hands back what it was given
        sorted_out = handle.deterministic_sort(True, False, recv_x, None, recv_idx, recv_w)
        assert sorted_out[0] is recv_x and sorted_out[2] is recv_idx and sorted_out[3] is recv_w
        exp = ref.v2_dispatch_compact(inputs, g.rank(), E)
        assert torch.equal(recv_x, exp["recv_x"])
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def _expert_outputs_by_thread(recv_x, count, rank, y, signals, expect):
    """A producer of the expert outputs running beside the combine: expert le's rows of y, then
    signals[le] = expect (written through an int32 view of the uint32 words)."""
    El = recv_x.shape[0]
    words = signals.view(torch.int32)

    def produce():
        for le in range(El):
            m = int(count[le])
            for i in range(m):
                y[le, i] = ref.expert_transform(recv_x[le, i], rank * El + le)
            words[le] = expect
    return threading.Thread(target=produce)


@pytest.mark.parametrize("ranks,nodes", [(2, 1), (4, 2)])
def test_hybrid_ep_signalled_combine(ranks, nodes):
    """overlap / src_signals: the combine hands expert le's rows over only once its signal reached
    the expected value, raised here by a thread that writes them while the combine waits; the
    result is the dense weighted sum of the final rows."""
    expect = 2**32 - 5  # above INT32_MAX: the words are compared unsigned

    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=53)
        x, idx, w = inputs[g.rank()]
        buf = _hybrid_buffer(g)
        recv_x, count, _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, CAP, E, topk_weights=w, use_fp8=False)
        y = torch.zeros_like(recv_x)
        signals = torch.zeros(E // g.size(), dtype=torch.uint32)
        producer = _expert_outputs_by_thread(recv_x, count, g.rank(), y, signals, expect - 2**32)
        producer.start()
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle, overlap=True, src_signals=signals,
                                                 src_signal_expect_value=expect)
        producer.join()
        want = ref.ll_combine(inputs, g.rank(), E, lambda t, e: ref.expert_transform(x[t], e))
        assert torch.equal(combined.view(torch.int16), want.view(torch.int16))
        # the signals are only read; without overlap, signals already raised pass at once
        assert bool((signals.view(torch.int32) == expect - 2**32).all())
        again, _, _ = buf.low_latency_combine(y, idx, w, handle, src_signals=signals.view(torch.int32),
                                              src_signal_expect_value=expect)
        assert torch.equal(again.view(torch.int16), want.view(torch.int16))
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(ranks, nodes).run(fn) == [True] * ranks


def _outcome(fn):
    try:
        fn()
        return ("ok", "", [])
    except moe_ep.PeerError as e:
        return (type(e).__name__, str(e), list(e.ranks))
    except Exception as e:  # the test compares each rank's error type and message
        return (type(e).__name__, str(e), [])


SIGNAL_REFUSALS = [
    (dict(overlap=True), "InvalidArgument", "overlap = true needs src_signals"),
    (dict(src_signals=torch.zeros(3, dtype=torch.int32)), "InvalidArgument", "src_signals"),
    (dict(src_signals=torch.zeros(2, dtype=torch.float32)), "InvalidArgument", "src_signals"),
    (dict(src_signals=[0, 0]), "TypeError", "src_signals"),
    (dict(src_signals=torch.zeros(2, dtype=torch.int32), src_signal_expect_value=-1), "InvalidArgument",
     "src_signal_expect_value = -1 is outside [0, 4294967295]"),
    (dict(src_signals=torch.zeros(2, dtype=torch.int32), src_signal_expect_value=2**32), "InvalidArgument",
     "src_signal_expect_value = 4294967296 is outside [0, 4294967295]"),
    # a signal nobody raises: a TimeoutError after half the buffer's timeout, not a hang
    (dict(src_signals=torch.zeros(2, dtype=torch.uint32), src_signal_expect_value=1), "TimeoutError",
     "src_signals[0] = 0"),
]


@pytest.mark.parametrize("kwargs,kind,words", SIGNAL_REFUSALS)
def test_hybrid_ep_signal_refusals_on_every_rank(kwargs, kind, words, monkeypatch):
    """Rank 1's bad signal arguments: it raises the typed error naming them, rank 0 a PeerError
    naming rank 1, and both buffers still work afterwards."""
    # Rank 1 gives up on an unraised signal after half the timeout (4 s) and tells rank 0, which
    # waits the whole timeout in the agreement: the other half is the margin for any load.
    monkeypatch.setenv("MOE_EP_TIMEOUT_SECS", "8")

    experts, topk = 4, 2  # two local experts per rank

    def fn(g):
        x, idx, w = ref.make_inputs(g.size(), N, H, experts, topk, seed=59)[g.rank()]
        buf = hybrid_ep.Buffer(g, 0, hybrid_ep.Buffer.get_low_latency_rdma_size_hint(CAP, H, 2, experts),
                               low_latency_mode=True, num_qps_per_rank=2, explicitly_destroy=True)
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, CAP, experts, use_fp8=False)
        got = _outcome(lambda: buf.low_latency_combine(recv_x, idx, w, handle, **(kwargs if g.rank() == 1 else {})))
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, CAP, experts, use_fp8=False)
        buf.low_latency_combine(recv_x, idx, w, handle)
        buf.destroy()
        return got
    bad, peer = moe_ep.LocalWorld(2, 1).run(fn)[::-1]
    assert bad[0] == kind and words in bad[1], bad
    assert kind == "TypeError" or bad[1].startswith("[rank 1]"), bad  # conversion errors name no rank
    assert peer[0] == "PeerError" and peer[2] == [1], peer


def test_get_local_buffer_tensor_views_the_ranks_own_buffers():
    """The scale-up buffer (num_nvl_bytes, zero-filled, private to the rank) and the scale-out pool
    (num_rdma_bytes): 1-D views of the bytes from `offset` on, shaped by `size`, that alias each
    other and keep the memory after destroy()."""
    nvl, rdma = 4096, hybrid_ep.Buffer.get_low_latency_rdma_size_hint(CAP, H, 2, E)

    def fn(g):
        buf = deep_ep.Buffer(g, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E // 2, explicitly_destroy=True)
        whole = buf.get_local_buffer_tensor(torch.float32)
        assert whole.dtype == torch.float32 and whole.shape == (nvl // 4,) and bool((whole == 0).all())
        tail = buf.get_local_buffer_tensor(torch.int64, offset=1024)
        assert tail.shape == ((nvl - 1024) // 8,)
        shaped = buf.get_local_buffer_tensor(torch.bfloat16, (3, 5), offset=16)
        assert shaped.shape == (3, 5) and shaped.dtype == torch.bfloat16
        # the same bytes, written through one view and read through the others
        whole[256:258] = torch.tensor([1.5, -2.0])
        assert tail[:1].view(torch.float32).tolist() == [1.5, -2.0]
        shaped[0, 0] = 3.0
        assert whole[4:5].view(torch.bfloat16)[0] == 3.0
        # odd widths: a float64 view drops the bytes that do not fill an element
        assert buf.get_local_buffer_tensor(torch.float64, offset=8).shape == ((nvl - 8) // 8,)
        # the rank's own memory: the other rank's view is another address with its own bytes
        pool = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        assert pool.shape == (rdma,)
        # the low-latency slots live in the pool: a dispatch writes there
        before = pool.clone()
        inputs = ref.make_inputs(g.size(), N, H, E, K, seed=61)
        x, idx, _ = inputs[g.rank()]
        buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False)
        assert not torch.equal(before, pool)
        ptrs = [whole.data_ptr()]
        buf.destroy()
        whole[0] = 7.0  # still mapped
        assert float(whole[0]) == 7.0
        with pytest.raises(moe_ep.StateError):
            buf.get_local_buffer_tensor(torch.float32)
        return ptrs
    ptrs = moe_ep.LocalWorld(2).run(fn)
    assert ptrs[0] != ptrs[1]


@pytest.mark.parametrize("call,kind,words", [
    (lambda b: b.get_local_buffer_tensor(torch.float32, offset=4100), "InvalidArgument",
     "offset = 4100 is outside [0, num_nvl_bytes = 4096]"),
    (lambda b: b.get_local_buffer_tensor(torch.float32, offset=-4), "InvalidArgument", "offset = -4 is outside"),
    (lambda b: b.get_local_buffer_tensor(torch.float32, offset=6), "InvalidArgument",
     "offset = 6 is not a multiple of the 4 bytes of torch.float32"),
    (lambda b: b.get_local_buffer_tensor(torch.float32, (33, 32)), "InvalidArgument",
     "size = (33, 32) needs 1056 elements of torch.float32; the buffer holds 1024"),
    (lambda b: b.get_local_buffer_tensor(torch.uint8, offset=1, use_rdma_buffer=True, size=(8193,)),
     "InvalidArgument", "size = (8193,) needs 8193 elements"),
    (lambda b: b.get_local_buffer_tensor("float32"), "TypeError", "dtype must be a torch.dtype"),
])
def test_get_local_buffer_tensor_refusals(call, kind, words):
    def fn(g):
        buf = deep_ep.Buffer(g, 4096, 8192)
        try:
            call(buf)
        except Exception as e:  # the test compares the type and message
            return type(e).__name__, str(e)
        return "ok", ""
    name, message = moe_ep.LocalWorld(1).run(fn)[0]
    assert name == kind and words in message, (name, message)


def test_next_combine_buffer_outlives_destroy():
    """get_next_low_latency_combine_buffer's view keeps the pool mapped: written after destroy(),
    it still holds what was written (nothing else uses the memory any more)."""
    def fn(g):
        x, idx, _ = ref.make_inputs(g.size(), N, H, E, K, seed=67)[g.rank()]
        buf = _hybrid_buffer(g)
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, CAP, E, use_fp8=False)
        view = buf.get_next_low_latency_combine_buffer(handle)
        assert view.dtype == torch.bfloat16 and view.shape == (E // g.size(), g.size() * CAP, H)
        buf.destroy()
        view.fill_(1.5)
        return bool((view == 1.5).all())
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]
