"""The package as users install it (docs/python.md, "Installing"): the `deep_ep` switch, what
`moe_ep.features()` reports, and the message of an extension built for another interpreter.

Every case runs in a fresh interpreter. From the build tree the wheel's start-up file
(moe_ep_deep_ep.pth) is processed from a site folder of the test's own (site.addsitedir, as the
interpreter processes the wheel's at start-up); from an installed wheel (MOE_EP_TEST_INSTALLED=1,
scripts/wheel-test.sh) the installed one is, and nothing else is put on a path. The build tree's
alias folder (build/deep_ep_alias) is never on the children's path here."""

import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import moe_ep
from conftest import INSTALLED, PYTHON_DIR, SOURCE_DIR

PTH = os.path.join(SOURCE_DIR, "python", "hook", "moe_ep_deep_ep.pth")


def run_python(code, tmp_path, switch=None, extra_path=(), check=True):
    """Runs code in a fresh interpreter with MOE_EP_DEEP_EP=switch (unset when None); returns the
    completed process (stdout, stderr as text)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_EP_DEEP_EP", "MOE_EP_CPU_COMPAT", "PYTHONPATH")}
    if switch is not None:
        env["MOE_EP_DEEP_EP"] = switch
    path = list(extra_path)
    prologue = ""
    if not INSTALLED:
        path.append(PYTHON_DIR)
        site_dir = tmp_path / "site"
        site_dir.mkdir(exist_ok=True)
        shutil.copy(PTH, site_dir)
        prologue = f"import site; site.addsitedir({str(site_dir)!r})\n"
    if path:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    r = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        pytest.fail(f"the child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}", pytrace=False)
    return r


def fake_deep_ep(tmp_path):
    """A folder holding a package named deep_ep that is not moe-ep's (as a real DeepEP would be)."""
    root = tmp_path / "real"
    (root / "deep_ep").mkdir(parents=True)
    (root / "deep_ep" / "__init__.py").write_text("WHO = 'the other deep_ep'\n")
    return root


def test_without_the_switch_deep_ep_is_not_ours(tmp_path):
    r = run_python("""
        import importlib.util, sys
        print(importlib.util.find_spec("deep_ep") is None, "moe_ep" in sys.modules, "torch" in sys.modules)
    """, tmp_path)
    # nothing resolves deep_ep, and start-up imported neither moe_ep nor torch
    assert r.stdout.split() == ["True", "False", "False"]
    assert r.stderr == ""


@pytest.mark.parametrize("off", ["0", "off", ""])
def test_switched_off_a_real_deep_ep_is_what_imports(tmp_path, off):
    r = run_python("import deep_ep; print(deep_ep.WHO)", tmp_path, switch=off, extra_path=[fake_deep_ep(tmp_path)])
    assert r.stdout.strip() == "the other deep_ep"
    assert r.stderr == ""


@pytest.mark.parametrize("on", ["1", "on", "ON"])
def test_switched_on_deep_ep_is_moe_ep_deep_ep(tmp_path, on):
    r = run_python("""
        import sys
        print("torch" in sys.modules)
        import deep_ep
        import deep_ep.buffers.legacy
        from deep_ep.utils import EventOverlap
        from deep_ep import Buffer, ElasticBuffer
        import moe_ep.deep_ep as impl, moe_ep.deep_ep.buffers.legacy as legacy
        print(deep_ep is impl, deep_ep.buffers.legacy is legacy, Buffer is impl.Buffer, EventOverlap is impl.EventOverlap)
        print(deep_ep.cpu_compat.installed())
    """, tmp_path, switch=on)
    lines = r.stdout.split("\n")
    assert lines[0] == "False"  # the switch itself imports nothing heavy before `import deep_ep`
    assert lines[1].split() == ["True"] * 4
    assert lines[2] == "False"  # "1" does not install the CPU compatibility layer
    assert r.stderr == ""


def test_switch_cpu_installs_the_compatibility_layer(tmp_path):
    r = run_python("""
        import torch
        import deep_ep
        print(deep_ep.cpu_compat.installed(), torch.cuda.is_available(), torch.cuda.device_count() > 0)
    """, tmp_path, switch="cpu")
    # the layer's contract (docs/python.md): device_count answers, is_available stays False
    assert r.stdout.split() == ["True", "False", "True"]


def test_switched_on_over_a_real_deep_ep_says_so_naming_both(tmp_path):
    real = fake_deep_ep(tmp_path)
    r = run_python("""
        import deep_ep, moe_ep.deep_ep
        print(deep_ep is moe_ep.deep_ep)
    """, tmp_path, switch="1", extra_path=[real])
    assert r.stdout.strip() == "True"
    assert "MOE_EP_DEEP_EP=1" in r.stderr
    assert str(real / "deep_ep") in r.stderr  # the other one
    assert os.path.dirname(os.path.abspath(moe_ep.__file__)) in r.stderr  # ours
    assert r.stderr.count("\n") == 1  # said once


@pytest.mark.parametrize("bad", ["yes", "2", "cuda"])
def test_a_value_the_switch_does_not_know_is_refused_naming_the_accepted_ones(tmp_path, bad):
    r = run_python("""
        import sys
        try:
            import deep_ep
        except ImportError as e:
            print("ImportError:", e)
            sys.exit(0)
        print("imported")
    """, tmp_path, switch=bad)
    out = r.stdout.strip()
    assert out.startswith("ImportError: MOE_EP_DEEP_EP=")
    assert repr(bad) in out
    for accepted in ("0", "off", "1", "on", "cpu"):
        assert accepted in out.split("accepted:")[1]
    assert r.stderr == ""  # start-up itself says nothing


def test_features_report_this_installation():
    f = moe_ep.features()
    assert f["version"] == moe_ep.__version__
    assert any(s in importlib.machinery.EXTENSION_SUFFIXES for s in f["python"].split(", "))
    assert isinstance(f["mpi"], bool)
    if f["mpi"]:
        importlib.import_module("moe_ep._C_mpi")  # reported as loading: it loads
        assert f["mpi_detail"] == ""
    else:
        assert "MPI" in f["mpi_detail"]
    assert isinstance(f["cuda"], bool) and f["cuda_detail"]


def test_an_extension_built_for_another_interpreter_is_named(tmp_path):
    # A copy of the package whose extension carries another CPython's suffix.
    pkg = tmp_path / "pkgs" / "moe_ep"
    shutil.copytree(os.path.dirname(os.path.abspath(moe_ep.__file__)), pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "_C_mpi*"))
    for p in pkg.glob("_C.*"):
        p.rename(pkg / "_C.cpython-399-x86_64-linux-gnu.so")
    env = {k: v for k, v in os.environ.items() if k != "MOE_EP_DEEP_EP"}
    env["PYTHONPATH"] = str(tmp_path / "pkgs")
    r = subprocess.run([sys.executable, "-c", "import moe_ep"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: this moe_ep")
    assert "_C.cpython-399-x86_64-linux-gnu.so" in last
    assert f"CPython {sys.version_info.major}.{sys.version_info.minor}" in last


def test_the_switch_and_moe_ep_env_accept_the_same_values(monkeypatch):
    """The start-up module reads MOE_EP_DEEP_EP without moe_ep (standard library only), so it keeps
    its own table; `moe-ep env` and moe_ep.env() judge the variable from the registry. They agree:
    the same accepted values, and each value valid for one is valid for the other."""
    switch = importlib.import_module("_moe_ep_deep_ep")
    entry = next(v for v in moe_ep.env() if v["name"] == "MOE_EP_DEEP_EP")
    accepted = ["" if a == "(empty)" else a for a in entry["accepted"].split(" | ")]
    assert sorted(accepted) == sorted(switch.VALUES)
    for value in accepted + ["ON", "Cpu", "yes", "2"]:
        monkeypatch.setenv("MOE_EP_DEEP_EP", value)
        entry = next(v for v in moe_ep.env() if v["name"] == "MOE_EP_DEEP_EP")
        try:
            switch.mode(value)
            switch_ok = True
        except ValueError:
            switch_ok = False
        assert switch_ok == (entry["error"] is None), (value, entry["error"])
