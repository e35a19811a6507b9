"""moe_ep.deep_ep.cpu_compat: off unless asked for (torch's CUDA calls fail as torch makes them
fail), and once installed, the stand-ins engines' DeepEP paths call. Tests that install the layer
do it in a child interpreter, so that the pytest process keeps torch as it is."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moe_ep
from moe_ep.deep_ep import cpu_compat

from conftest import ALIAS_DIR, PYTHON_DIR


def run_python(code, env=None):
    """Runs `code` in a fresh interpreter with the build tree's package; returns (rc, out, err)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR, ALIAS_DIR])
    full_env.pop("MOE_EP_CPU_COMPAT", None)
    full_env.update(env or {})
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


def failure_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the type is what is compared)
        return type(e)
    return None


CUDA_ONLY_CALLS = {
    "get_device_properties": lambda: torch.cuda.get_device_properties(0),
    "current_stream": lambda: torch.cuda.current_stream(),
    "zeros on cuda": lambda: torch.zeros(2, device="cuda"),
    "Tensor.cuda": lambda: torch.zeros(2).cuda(),
    "Event.record": lambda: torch.cuda.Event().record(),
}


@pytest.mark.parametrize("call", CUDA_ONLY_CALLS)
def test_not_installed_cuda_calls_fail_as_torch_makes_them_fail(call):
    """This process imported moe_ep.deep_ep without asking for the layer."""
    assert not cpu_compat.installed()
    assert failure_of(CUDA_ONLY_CALLS[call]) is not None, f"{call} worked on a host without CUDA"


def test_importing_does_not_change_torch():
    code = """
        import torch
        before = {n: getattr(torch.cuda, n) for n in ("get_device_properties", "current_stream", "Stream", "Event",
                                                       "synchronize", "device_count", "set_device")}
        init = __import__("torch.distributed", fromlist=["x"]).init_process_group
        import deep_ep, moe_ep.deep_ep
        assert deep_ep is moe_ep.deep_ep
        after = {n: getattr(torch.cuda, n) for n in before}
        assert before == after, [n for n in before if before[n] is not after[n]]
        assert torch.distributed.init_process_group is init
        assert not deep_ep.cpu_compat.installed()
        try:
            torch.zeros(1, device="cuda")
        except Exception as e:
            print(type(e).__name__)
    """
    rc, out, err = run_python(code)
    assert rc == 0, err
    assert out.strip() == failure_of(CUDA_ONLY_CALLS["zeros on cuda"]).__name__


def test_installed_device_queries_streams_and_events():
    code = """
        import torch
        from moe_ep.deep_ep import cpu_compat
        cpu_compat.install(device_count=4, multi_processor_count=78, capability=(10, 0))
        assert torch.cuda.device_count() == 4 and torch.cuda.current_device() == 0
        torch.cuda.set_device(3)
        assert torch.cuda.current_device() == 3
        with torch.cuda.device(1):
            assert torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 3
        props = torch.cuda.get_device_properties(device="cuda")
        assert props.multi_processor_count == 78 and (props.major, props.minor) == (10, 0) and props.total_memory > 0
        assert torch.cuda.get_device_capability() == (10, 0)
        try:
            torch.cuda.set_device(4)
            raise SystemExit("set_device(4) of 4 devices was accepted")
        except ValueError as e:
            assert "device index 4 is outside the 4 devices" in str(e), e
        s = torch.cuda.Stream()
        assert isinstance(s, torch.cuda.Stream) and torch.cuda.current_stream() is torch.cuda.default_stream()
        with torch.cuda.stream(s):
            assert torch.cuda.current_stream() is s
            s.wait_stream(torch.cuda.default_stream())
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sum(range(100000))
        end.record(s)
        assert end.query() and start.elapsed_time(end) > 0
        try:
            torch.cuda.Event().elapsed_time(torch.cuda.Event())
            raise SystemExit("elapsed_time without enable_timing was accepted")
        except RuntimeError:
            pass
        torch.cuda.synchronize()
        assert torch.cuda.is_current_stream_capturing() is False
        assert torch.get_device_module("cuda").current_stream() is torch.cuda.default_stream()
        assert torch.cuda.is_available() is False  # code that asks gets the truth
        calls = cpu_compat.calls()
        assert calls["torch.cuda.get_device_properties"] == 1 and calls["torch.cuda.Event"] == 4, calls
        print("ok")
    """
    rc, out, err = run_python(code)
    assert rc == 0 and out.strip() == "ok", err


def test_installed_cuda_devices_mean_the_cpu():
    code = """
        import torch
        from moe_ep.deep_ep import cpu_compat
        cpu_compat.install()
        made = [torch.zeros(2, device="cuda"), torch.empty(2, device="cuda:3", pin_memory=True),
                torch.arange(4, device=torch.device("cuda", 1)), torch.ones(2).cuda(), torch.ones(2).to("cuda"),
                torch.ones(2).to(device="cuda:0", dtype=torch.float16), torch.ones(2).new_zeros(3, device="cuda"),
                torch.randn(2, 2, device=0)]
        assert all(t.device.type == "cpu" for t in made), [t.device for t in made]
        assert made[5].dtype == torch.float16
        torch.ones(2).record_stream(torch.cuda.current_stream())
        torch.set_default_device("cuda")
        assert torch.zeros(1).device.type == "cpu"
        torch.set_default_device("cpu")
        # The ranks of a LocalWorld get the mapping too.
        import moe_ep
        print(moe_ep.LocalWorld(2).run(lambda g: torch.zeros(1, device="cuda").device.type))
        cpu_compat.uninstall()
        try:
            torch.zeros(1, device="cuda")
            raise SystemExit("device='cuda' still mapped after uninstall")
        except RuntimeError:
            pass
        assert not cpu_compat.installed()
    """
    rc, out, err = run_python(code)
    assert rc == 0, err
    assert out.strip() == "['cpu', 'cpu']"


def test_uninstall_restores_what_install_replaced():
    code = """
        import torch, torch.distributed as dist
        names = ("get_device_properties", "current_stream", "Stream", "Event", "synchronize", "set_device", "device")
        before = {n: getattr(torch.cuda, n) for n in names}
        init, new_group, default = dist.init_process_group, dist.new_group, torch.set_default_device
        gather = dist.all_gather_into_tensor
        record = torch.Tensor.record_stream
        from moe_ep.deep_ep import cpu_compat
        with cpu_compat.enabled():
            assert torch.cuda.Stream is not before["Stream"] and cpu_compat.installed()
            assert torch.Tensor.record_stream is not record
        assert {n: getattr(torch.cuda, n) for n in names} == before
        assert (dist.init_process_group, dist.new_group, torch.set_default_device) == (init, new_group, default)
        assert dist.all_gather_into_tensor is gather
        assert torch.Tensor.record_stream is record
        print("ok")
    """
    rc, out, err = run_python(code)
    assert rc == 0 and out.strip() == "ok", err


def test_nccl_process_groups_are_gloo():
    code = """
        import os, tempfile, torch, torch.distributed as dist
        from moe_ep.deep_ep import cpu_compat
        cpu_compat.install()
        path = tempfile.mktemp()
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        sub = dist.new_group([0], backend="nccl")
        t = torch.ones(3, device="cuda")
        dist.all_reduce(t, group=sub)
        print(dist.get_backend(), dist.get_backend(sub), t.tolist(), cpu_compat.calls()["nccl -> gloo"])
        dist.destroy_process_group()
    """
    rc, out, err = run_python(code)
    assert rc == 0, err
    assert out.strip() == "gloo gloo [1.0, 1.0, 1.0] 2"


def test_stacked_all_gather_into_tensor_works_on_gloo():
    """NCCL's stacked output form ([world, n, ...]), which gloo refuses, gathers through the
    concatenated view; the concatenated form is unchanged."""
    code = """
        import tempfile, torch, torch.distributed as dist
        from moe_ep.deep_ep import cpu_compat
        cpu_compat.install()
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
        x = torch.arange(6, device="cuda").view(2, 3)
        stacked, flat = torch.zeros(1, 2, 3, dtype=x.dtype), torch.zeros(2, 3, dtype=x.dtype)
        dist.all_gather_into_tensor(stacked, x)
        dist.all_gather_into_tensor(flat, x)
        print(stacked.tolist(), flat.tolist(), cpu_compat.calls()["stacked all_gather_into_tensor"])
        dist.destroy_process_group()
    """
    rc, out, err = run_python(code)
    assert rc == 0, err
    assert out.strip() == "[[[0, 1, 2], [3, 4, 5]]] [[0, 1, 2], [3, 4, 5]] 1"


def test_the_environment_variable_installs_it_at_import():
    code = """
        import torch
        import deep_ep
        print(deep_ep.cpu_compat.installed(), torch.zeros(1, device="cuda").device.type)
    """
    rc, out, err = run_python(code, {"MOE_EP_CPU_COMPAT": "1"})
    assert rc == 0 and out.strip() == "True cpu", err
    rc, out, err = run_python("import deep_ep; print(deep_ep.cpu_compat.installed())", {"MOE_EP_CPU_COMPAT": "0"})
    assert rc == 0 and out.strip() == "False", err
    rc, out, err = run_python("import deep_ep", {"MOE_EP_CPU_COMPAT": "maybe"})
    assert rc != 0 and "MOE_EP_CPU_COMPAT" in err and "maybe" in err, err


@pytest.mark.parametrize("settings,message", [
    (dict(device_count=0), "device_count = 0"),
    (dict(multi_processor_count=-1), "multi_processor_count = -1"),
    (dict(capability=(9,)), "capability = (9,)"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cpu_compat.install(**settings)
    assert not cpu_compat.installed()


# ---- torch.accelerator, Stream.is_capturing and is_available ------------------------------------
#
# Each group of checks runs once in a child interpreter (module-scoped fixtures) and reports one
# line per check; the tests below assert them one by one.

ACCELERATOR_FUNCTIONS = ("current_accelerator", "device_count", "set_device_index", "current_device_index",
                         "synchronize", "current_stream", "is_available", "device_index", "set_stream")


def run_checks(code, env=None):
    """Runs `code` (which fills CHECKS: name -> function) in a child interpreter; returns
    {name: "ok" or the failure}."""
    driver = textwrap.dedent(code) + textwrap.dedent("""
        import json, traceback
        report = {}
        for name, check in CHECKS.items():
            try:
                check()
                report[name] = "ok"
            except BaseException:  # noqa: BLE001 (reported to the test)
                report[name] = traceback.format_exc()
        print("REPORT " + json.dumps(report))
    """)
    rc, out, err = run_python(driver, env)
    assert rc == 0, err
    line = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
    assert line, out + err
    import json
    return json.loads(line[-1][len("REPORT "):])


# What torch answers: each call's value (repr) or the type of its exception. The child computes it
# three times: in a fresh interpreter, after importing moe_ep.deep_ep without the layer, and after
# install() + uninstall(); each function object must also be torch's own every time.
_TORCHS_ANSWERS = """
    import torch
    CALLS = {
        "current_accelerator": lambda: torch.accelerator.current_accelerator(),
        "current_accelerator(check_available=True)": lambda: torch.accelerator.current_accelerator(True),
        "device_count": lambda: torch.accelerator.device_count(),
        "set_device_index": lambda: torch.accelerator.set_device_index(0),
        "current_device_index": lambda: torch.accelerator.current_device_index(),
        "synchronize": lambda: torch.accelerator.synchronize(),
        "current_stream": lambda: torch.accelerator.current_stream().is_capturing(),
        "is_available": lambda: torch.accelerator.is_available(),
        "device_index": lambda: torch.accelerator.device_index(0).__enter__(),
        "set_stream": lambda: torch.accelerator.set_stream(torch.Stream(device="cpu")),
        "torch.cuda.is_available": lambda: torch.cuda.is_available(),
        "torch.cuda.is_current_stream_capturing": lambda: torch.cuda.is_current_stream_capturing(),
    }

    def answers():
        out = {}
        for name, call in CALLS.items():
            try:
                out[name] = "value " + repr(call())
            except Exception as e:
                out[name] = "raises " + type(e).__name__
        return out

    def objects():
        names = [n for n in ("current_accelerator", "device_count", "set_device_index", "current_device_index",
                             "synchronize", "current_stream", "is_available", "device_index", "set_stream",
                             "current_device_idx", "set_device_idx", "empty_cache", "get_memory_info")
                 if hasattr(torch.accelerator, n)]
        return {n: getattr(torch.accelerator, n) for n in names}, {
            n: getattr(torch.cuda, n) for n in ("is_available", "is_current_stream_capturing", "device_count")}

    fresh, fresh_objects = answers(), objects()
    import deep_ep
    from moe_ep.deep_ep import cpu_compat
    assert not cpu_compat.installed()
    imported, imported_objects = answers(), objects()
    cpu_compat.install()
    cpu_compat.uninstall()
    after, after_objects = answers(), objects()
    CHECKS = {}
    for name in CALLS:
        def check(name=name):
            assert imported[name] == fresh[name], (imported[name], fresh[name])
            assert after[name] == fresh[name], (after[name], fresh[name])
            key = name.split("(")[0]
            for table in (0, 1):
                for n, obj in fresh_objects[table].items():
                    if n == key or key == "torch.cuda." + n:
                        assert imported_objects[table][n] is obj and after_objects[table][n] is obj, n
        CHECKS[name] = check
"""


@pytest.fixture(scope="module")
def torchs_answers():
    return run_checks(_TORCHS_ANSWERS)


@pytest.mark.parametrize("function", ACCELERATOR_FUNCTIONS + ("current_accelerator(check_available=True)",
                                                              "torch.cuda.is_available",
                                                              "torch.cuda.is_current_stream_capturing"))
def test_not_installed_torch_answers_as_itself(function, torchs_answers):
    """Importing moe_ep.deep_ep changes nothing, and uninstall() restores torch's functions: every
    call answers as in a fresh interpreter (its value, or the exception it raises)."""
    assert torchs_answers[function] == "ok", torchs_answers[function]


_INSTALLED = """
    import torch
    truth = torch.cuda.is_available()  # torch's own answer, before the layer
    from moe_ep.deep_ep import cpu_compat
    cpu_compat.install(device_count=4)
    acc = torch.accelerator

    def current_accelerator():
        assert acc.current_accelerator() == torch.device("cuda")
        # check_available=True adds the runtime check: torch's own is_available.
        assert acc.current_accelerator(check_available=True) == (torch.device("cuda") if truth else None)

    def device_count():
        assert acc.device_count() == 4 == torch.cuda.device_count()

    def set_device_index():
        acc.set_device_index(2)
        assert torch.cuda.current_device() == 2
        acc.set_device_index(torch.device("cuda", 1))
        assert torch.cuda.current_device() == 1
        acc.set_device_index(-1)  # torch: a negative index changes nothing
        assert torch.cuda.current_device() == 1
        for bad, error in ((4, ValueError), (torch.device("cuda"), ValueError), ("cpu", ValueError)):
            try:
                acc.set_device_index(bad)
            except error:
                pass
            else:
                raise AssertionError(f"set_device_index({bad!r}) was accepted")
        torch.cuda.set_device(0)

    def current_device_index():
        torch.cuda.set_device(3)
        assert acc.current_device_index() == 3
        torch.cuda.set_device(0)
        assert acc.current_device_index() == 0

    def synchronize():
        assert acc.synchronize() is None and acc.synchronize(0) is None and acc.synchronize("cuda:3") is None

    def current_stream():
        s = acc.current_stream()
        assert s is torch.cuda.current_stream() and s is acc.current_stream(torch.device("cuda", 0))
        assert s.is_capturing() is False
        inner = torch.cuda.Stream()
        with torch.cuda.stream(inner):
            assert acc.current_stream() is inner and inner.is_capturing() is False
        assert acc.current_stream() is s

    def is_available():
        assert acc.is_available() is truth and torch.cuda.is_available() is truth

    def device_index():
        torch.cuda.set_device(0)
        with acc.device_index(2):
            assert acc.current_device_index() == 2 == torch.cuda.current_device()
        assert acc.current_device_index() == 0
        with acc.device_index(None):
            assert acc.current_device_index() == 0

    def set_stream():
        s = torch.cuda.Stream()
        acc.set_stream(s)
        assert acc.current_stream() is s is torch.cuda.current_stream()
        acc.set_stream(torch.cuda.default_stream())
        assert acc.current_stream() is torch.cuda.default_stream()

    def is_current_stream_capturing():
        assert torch.cuda.is_current_stream_capturing() is False

    CHECKS = {name: fn for name, fn in dict(globals()).items()
              if callable(fn) and name in {"current_accelerator", "device_count", "set_device_index",
                                           "current_device_index", "synchronize", "current_stream", "is_available",
                                           "device_index", "set_stream", "is_current_stream_capturing"}}
    assert all(hasattr(acc, n) for n in CHECKS if n != "is_current_stream_capturing"), "torch lacks one"
"""


@pytest.fixture(scope="module")
def installed_answers():
    return run_checks(_INSTALLED)


@pytest.mark.parametrize("function", ACCELERATOR_FUNCTIONS + ("is_current_stream_capturing",))
def test_installed_torch_accelerator_answers_as_the_layer(function, installed_answers):
    """With the layer installed, torch.accelerator answers as the layer's torch.cuda (CUDA the
    accelerator, its devices, the current device, its streams, never capturing); is_available
    stays torch's own answer."""
    assert installed_answers[function] == "ok", installed_answers[function]


def test_nvml_based_check_keeps_is_available_true_to_torch():
    """PYTORCH_NVML_BASED_CUDA_CHECK=1 (set before torch is imported) makes torch.cuda.is_available
    count devices; the layer's 8 stand-in devices must not make it True where torch says False."""
    nvml = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    rc, out, err = run_python("import torch; print(torch.cuda.is_available(), torch.accelerator.is_available())",
                              nvml)
    assert rc == 0, err
    truth = out.split()
    assert truth[0] == truth[1], out
    rc, out, err = run_python("import deep_ep, torch; print(torch.cuda.is_available(), "
                              "torch.accelerator.is_available(), torch.cuda.device_count(), "
                              "deep_ep.cpu_compat.installed())", dict(nvml, MOE_EP_CPU_COMPAT="1"))
    assert rc == 0, err
    assert out.split() == [truth[0], truth[0], "8", "True"], out
    # The same after uninstall(), and within a process that asked torch before installing.
    rc, out, err = run_python("""
        import torch
        before = torch.cuda.is_available()
        from moe_ep.deep_ep import cpu_compat
        cpu_compat.install()
        during = (torch.cuda.is_available(), torch.accelerator.is_available())
        cpu_compat.uninstall()
        print(before, *during, torch.cuda.is_available())
    """, nvml)
    assert rc == 0, err
    assert out.split() == [truth[0]] * 4, out
