"""The torch the package runs on: real float8_e4m3fn tensors in and out, dtypes moe-ep does not
move refused with TypeError naming the argument and the dtype, and the supported torch range
enforced at import.

The float8 round trips are the regression test of a defect in which every call that returned a
tensor raised "Object of type 'torch.dtype' is not an instance of 'none'" on any torch with
float8_e4m3fn. Expected bytes come from the inputs (pass-through FP8 is copied verbatim)."""

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

import reference as ref

H, E, K, T, N = 256, 8, 2, 8, 6


def _codes(n, h, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x7E, (n, h), generator=g, dtype=torch.int64).to(torch.uint8)
    return codes | (torch.randint(0, 2, (n, h), generator=g) * 128).to(torch.uint8)


def test_the_suite_runs_on_a_torch_with_float8():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert (major, minor) >= (2, 1), torch.__version__
    assert hasattr(torch, "float8_e4m3fn")


def test_float8_dispatch_round_trip_v2():
    """V2 pass-through FP8: recv_x is a torch.float8_e4m3fn tensor holding the sources' codes."""
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, 3)
        counts = [inputs[s][0].shape[0] for s in range(g.size())]
        codes = [_codes(counts[s], H, 10 + s) for s in range(g.size())]
        scales = [torch.rand(counts[s], H // 128, generator=torch.Generator().manual_seed(20 + s))
                  for s in range(g.size())]
        _, idx, w = inputs[g.rank()]
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, use_fp8_dispatch=True,
                                    explicitly_destroy=True)
        x_fp8 = codes[g.rank()].view(torch.float8_e4m3fn)
        (recv_x, recv_sf), recv_idx, recv_w, handle, _ = buf.dispatch((x_fp8, scales[g.rank()]), topk_idx=idx,
                                                                      topk_weights=w, num_experts=E)
        assert recv_x.dtype == torch.float8_e4m3fn and recv_sf.dtype == torch.float32
        rows = ref.v2_received(inputs, g.rank(), E)
        assert recv_x.shape == (len(rows), H)
        for i, (s, t) in enumerate(rows):
            assert torch.equal(recv_x[i].view(torch.uint8), codes[s][t]), (i, s, t)
            assert torch.equal(recv_sf[i], scales[s][t]), (i, s, t)
        # The FP8 rows feed torch directly: a float8 tensor converts like any other.
        assert recv_x.float().dtype == torch.float32
        buf.destroy()
        return len(rows)
    assert sum(moe_ep.LocalWorld(2).run(fn)) > 0


def test_float8_low_latency_and_allocation():
    """V1 low-latency FP8 returns float8_e4m3fn data (DeepEP's type); moe_ep.empty allocates float8."""
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, 512, E, K, 4)
        x, idx, _ = inputs[g.rank()]
        buf = deep_ep.Buffer(g, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, 512, g.size(), E),
                             low_latency_mode=True, explicitly_destroy=True)
        (data, scales), count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        buf.destroy()
        return int(count.sum())
    selections = sum(int((idx >= 0).sum()) for _, idx, _ in ref.make_inputs(2, N, 512, E, K, 4))
    assert sum(moe_ep.LocalWorld(2).run(fn)) == selections
    t = moe_ep.empty(3, 16, dtype=torch.float8_e4m3fn)
    assert t.dtype == torch.float8_e4m3fn and t.shape == (3, 16)


# Dtypes the installed torch has and moe-ep does not move.
_REFUSED = [torch.float64, torch.complex64, torch.float8_e5m2]
if hasattr(torch, "uint16"):
    _REFUSED.append(torch.uint16)


@pytest.mark.parametrize("dtype", _REFUSED, ids=str)
@pytest.mark.parametrize("argument", ["x", "topk_weights", "combine x"])
def test_unmoved_dtypes_are_type_errors_naming_the_argument(dtype, argument):
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, 5)
        x, idx, w = inputs[g.rank()]
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
        bad = lambda t: torch.zeros(t.shape, dtype=dtype)
        try:
            with pytest.raises(TypeError) as info:
                if argument == "x":
                    buf.dispatch(bad(x), topk_idx=idx, topk_weights=w, num_experts=E)
                elif argument == "topk_weights":
                    buf.dispatch(x, topk_idx=idx, topk_weights=bad(w), num_experts=E)
                else:
                    recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
                    buf.combine(bad(recv_x), handle)
            return str(info.value)
        finally:
            buf.destroy()
    messages = moe_ep.LocalWorld(1).run(fn)
    name = "x" if argument == "combine x" else argument
    assert messages[0].startswith(f"{name} has dtype {dtype}, which moe-ep does not move"), messages[0]


def test_unmoved_dtype_from_numpy():
    import numpy as np

    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, 6)
        x, idx, w = inputs[g.rank()]
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
        try:
            with pytest.raises(TypeError, match=r"^topk_weights has dtype float64, which moe-ep does not move"):
                buf.dispatch(x, topk_idx=idx, topk_weights=np.zeros((N, K)), num_experts=E)
        finally:
            buf.destroy()
    moe_ep.LocalWorld(1).run(fn)


@pytest.mark.parametrize("version", ["1.13.1", "2.0.1+cu118", "3.0.0", "nightly"])
def test_torch_outside_the_supported_range_is_refused(version):
    with pytest.raises(ImportError) as info:
        moe_ep._check_torch(version)
    assert f"has torch {version}" in str(info.value) and "needs torch >= 2.1 and < 3.0" in str(info.value)


@pytest.mark.parametrize("version", ["2.1.0", "2.15.0+cu132", "2.99.0a0"])
def test_torch_inside_the_supported_range_is_accepted(version):
    moe_ep._check_torch(version)


def test_import_refuses_an_old_torch(tmp_path):
    """`import moe_ep` under a torch that reports 1.13.1 (a stand-in package first on the path)."""
    import os
    import subprocess
    import sys

    from conftest import PYTHON_DIR
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('__version__ = "1.13.1"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), PYTHON_DIR]))
    p = subprocess.run([sys.executable, "-c", "import moe_ep"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0
    assert "ImportError: moe_ep needs torch >= 2.1 and < 3.0; this interpreter has torch 1.13.1" in p.stderr, p.stderr
