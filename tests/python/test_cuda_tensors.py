"""CUDA tensors from Python: which provider backs an ElasticBuffer, and how CUDA tensors are
refused where they cannot be served (every machine); the CUDA provider from torch against the
built-in CPU buffer, bit for bit, on torch's current streams and events (tests marked gpu: skipped, with
the reason, without a CUDA device or without the CUDA provider)."""

import ctypes

import pytest
import torch

import moe_ep
from moe_ep import _C, deep_ep
from moe_ep.deep_ep.buffers import _provider

T, H, K, E = 16, 256, 4, 16
KDL_CUDA = 2


class FakeCudaTensor:
    """An object whose DLPack capsule says kDLCUDA (device 0) over a host tensor's bytes: what a
    torch CUDA tensor hands over, without a GPU. Only the device is read before the refusal."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        capsule = self.tensor.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        managed = get(capsule, b"dltensor")
        ctypes.c_int32.from_address(managed + ctypes.sizeof(ctypes.c_void_p)).value = KDL_CUDA  # DLTensor.device
        return capsule


def inputs(rank, device="cpu"):
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[::5, -1] = -1  # some unused lanes
    w = torch.rand(T, K, generator=gen)
    return x.to(device), idx.to(device), w.to(device)


def buffer(g):
    return deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)


# ---- every machine ------------------------------------------------------------------------------

def test_choice_without_torch_cuda():
    def fn(g):
        return _provider.choose(g, cuda_available=False)
    choice = moe_ep.LocalWorld(1).run(fn)[0]
    assert not choice.cuda
    assert "torch.cuda.is_available() is False" in choice.why_host


def test_choice_without_a_usable_provider(monkeypatch):
    monkeypatch.delenv("MOE_EP_PROVIDER_PATH", raising=False)
    found = _C.cuda_provider("")
    if found["available"]:
        pytest.skip("the CUDA provider is usable here: its refusal is not reachable")
    # Built with CUDA: the library's init says there is no device; without: there is no library.
    assert "no CUDA device" in found["reason"] or "does not exist" in found["reason"], found["reason"]

    def fn(g):
        return _provider.choose(g, cuda_available=True)  # as if torch saw a device
    choice = moe_ep.LocalWorld(1).run(fn)[0]
    assert not choice.cuda and found["reason"] in choice.why_host


def test_provider_path_naming_only_cpu_keeps_the_builtin_provider():
    found = _C.cuda_provider("cpu")
    assert not found["available"] and "gives V2 to provider 'cpu'" in found["reason"]


def test_cpu_buffer_refuses_cuda_tensors_saying_why():
    def fn(g):
        buf = buffer(g)
        assert buf.provider == "cpu" and buf.device == torch.device("cpu")
        x, idx, w = inputs(g.rank())
        with pytest.raises(TypeError, match=r"x is on DLPack device type 2, but this ElasticBuffer runs on moe-ep's "
                                            r"built-in CPU provider.*\(.+\): pass CPU tensors"):
            buf.dispatch(FakeCudaTensor(x), topk_idx=idx, topk_weights=w, num_experts=E)
        with pytest.raises(TypeError, match=r"topk_idx is on DLPack device type 2"):
            buf.dispatch(x, topk_idx=FakeCudaTensor(idx), topk_weights=w, num_experts=E)
        # The refusal reached every rank; the buffer still works.
        recv, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        with pytest.raises(TypeError, match=r"\bx is on DLPack device type 2"):
            buf.combine(FakeCudaTensor(recv), handle)
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def test_a_rank_that_cannot_use_its_device_fails_every_rank(monkeypatch):
    refusal = "[rank 1] ElasticBuffer: torch's current device is cuda:1, but ..."

    def choose(g):
        return _provider.Choice(True, device=1, refusal=refusal) if g.rank() == 1 else _provider.Choice(False)
    monkeypatch.setattr(_provider, "choose", choose)

    def fn(g):
        try:
            buffer(g)
        except moe_ep.Error as e:
            return type(e).__name__, str(e)
        return "built", ""
    results = moe_ep.LocalWorld(2).run(fn)
    assert results[1] == ("InvalidArgument", refusal)
    assert results[0][0] == "PeerError" and "rank 1" in results[0][1]


def test_v1_buffer_refuses_cuda_tensors_saying_why():
    def fn(g):
        buf = deep_ep.Buffer(g, num_nvl_bytes=1 << 20, explicitly_destroy=True)
        _, idx, _ = inputs(g.rank())
        with pytest.raises(TypeError, match=r"topk_idx is on DLPack device type 2, but Buffer \(V1\) runs on "
                                            r"moe-ep's built-in CPU provider"):
            buf.get_dispatch_layout(FakeCudaTensor(idx), E)
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(1).run(fn) == [True]


def test_dispatcher_refuses_cuda_tensors_saying_why():
    def fn(g):
        cache = moe_ep.BufferCache(g)
        d = moe_ep.TokenDispatcher(cache, H, E, K, num_max_dispatch_tokens_per_rank=T,
                                   num_max_prefill_tokens_per_rank=T)
        x, idx, w = inputs(g.rank())
        with pytest.raises(moe_ep.InvalidArgument, match=r"x lives on cuda:0: the token dispatcher works on host "
                                                         r"tensors whatever its provider"):
            d.dispatch(FakeCudaTensor(x), idx, w)
        out = d.dispatch(x, idx, w)  # still usable
        assert out.hidden_states is not None
        del d
        cache.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


# ---- GPU: the CUDA provider from torch ---------------------------------------------------------

def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    found = _C.cuda_provider(_provider.provider_path())
    return None if found["available"] else f"the CUDA provider is not usable: {found['reason']}"


gpu = pytest.mark.gpu


@pytest.fixture
def cuda_ready():
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)


def run_reference(monkeypatch, ranks, **calls):
    """The built-in CPU buffer's outputs for the same inputs (MOE_EP_PROVIDER_PATH=cpu keeps it)."""
    monkeypatch.setenv("MOE_EP_PROVIDER_PATH", "cpu")
    try:
        return moe_ep.LocalWorld(ranks).run(lambda g: round_trip(g, "cpu", **calls))
    finally:
        monkeypatch.delenv("MOE_EP_PROVIDER_PATH")


def round_trip(g, device, async_=False):
    """Dispatch, then combine the received rows (scaled by 2), on `device`; outputs on the CPU. On
    CUDA each rank (a thread) makes its own stream current: ranks sharing a stream serialize there
    (docs/cuda.md), so the calls run on torch's current stream, never the default one."""
    if device != "cpu":
        torch.cuda.set_device(0)
    buf = buffer(g)
    assert buf.provider == ("cpu" if device == "cpu" else "cuda")
    x, idx, w = inputs(g.rank(), device)
    side = torch.cuda.Stream() if device != "cpu" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())  # the inputs were made on the current stream
    with torch.cuda.stream(side) if side is not None else _nothing():
        recv_x, recv_idx, recv_w, handle, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                            async_with_compute_stream=async_)
        if async_:
            ev.current_stream_wait()
        y = recv_x.float().mul(2).to(torch.bfloat16)
        combined, combined_w, ev = buf.combine(y, handle, topk_weights=recv_w, async_with_compute_stream=async_)
        if async_:
            ev.current_stream_wait()
        out = [t.cpu() for t in (recv_x, recv_idx, recv_w, combined, combined_w)]  # read on the call's stream
    buf.destroy()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@gpu
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_buffer_matches_the_cpu_buffer(cuda_ready, monkeypatch, mode):
    calls = {"sync": {}, "async": {"async_": True}}[mode]
    expected = run_reference(monkeypatch, 2, **calls)
    got = moe_ep.LocalWorld(2).run(lambda g: round_trip(g, "cuda", **calls))
    names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "combined_x", "combined_topk_weights")
    for rank in range(2):
        for name, a, b in zip(names, got[rank], expected[rank]):
            assert a.dtype == b.dtype and a.shape == b.shape, (rank, name)
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), (rank, name)


@gpu
def test_cuda_buffer_outputs_are_cuda_tensors_and_host_inputs_are_refused(cuda_ready):
    def fn(g):
        torch.cuda.set_device(0)
        torch.cuda.set_stream(torch.cuda.Stream())  # each rank its own stream
        buf = buffer(g)
        assert buf.provider == "cuda" and buf.device == torch.device("cuda", 0)
        x, idx, w = inputs(g.rank(), "cuda")
        with pytest.raises(moe_ep.InvalidArgument, match=r"\bx lives on cpu, expected cuda:0"):
            buf.dispatch(x.cpu(), topk_idx=idx, topk_weights=w, num_experts=E)
        with pytest.raises(moe_ep.InvalidArgument, match=r"\bx\b"):
            buf.dispatch(torch.cat([x, x], 1)[:, ::2], topk_idx=idx, topk_weights=w, num_experts=E)
        recv_x, recv_idx, _, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        assert recv_x.device == torch.device("cuda", 0) and recv_idx.device == torch.device("cuda", 0)
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]
