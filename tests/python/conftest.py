"""Fixtures and helpers of the Python package's tests.

The package comes from PYTHONPATH (the build tree: build/python, and build/deep_ep_alias for
`import deep_ep`); nothing here edits sys.path for it.

`run_processes(fn, n, ...)` starts n fresh processes that join one gloo process group (a
file:// rendezvous in a temporary directory), calls fn(rank, world, group, *args) in each and
returns per rank ("ok", result) / ("error", info dict) / ("exit", exitcode). Children report
through a multiprocessing queue (plain Python values only: no tensors cross, so no shared-memory
transport of torch's is involved); an overall deadline kills whatever is left. The processes come
from multiprocessing's fork server, which has imported torch and torch.distributed once (and
nothing else: moe_ep, and whatever reads the environment when imported, is imported by each
process after its environment is set), so a process starts in milliseconds instead of seconds.
"""

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import tempfile
import time

import pytest

import moe_ep
import process_child

# MOE_EP_TEST_INSTALLED=1: moe_ep is an installed wheel (scripts/wheel-test.sh), `import deep_ep`
# resolves through the wheel's switch (MOE_EP_DEEP_EP), and no build-tree folder is put on any path.
INSTALLED = os.environ.get("MOE_EP_TEST_INSTALLED") == "1"
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if INSTALLED and os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(moe_ep.__file__)))) not in (
        "site-packages", "dist-packages"):
    raise RuntimeError(f"MOE_EP_TEST_INSTALLED=1, but moe_ep is not an installed package ({moe_ep.__file__})")

BUILD_DIR = os.environ.get("MOE_EP_BUILD_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(moe_ep.__file__))))
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(moe_ep.__file__)))
ALIAS_DIR = os.path.join(BUILD_DIR, "deep_ep_alias")


_PROCESSES = mp.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["torch", "torch.distributed"])


def provider_library(name):
    """Path of a test provider library built by tests/CMakeLists.txt (libprovider_<name>.so)."""
    return os.path.join(BUILD_DIR, "tests", f"libprovider_{name}.so")


def run_processes(fn, n, args=(), env=None, timeout=150, expect_missing=(), clean_exit=True):
    """Runs fn(rank, world, group, *args) in n processes; returns {rank: (status, value)}.

    Ranks in expect_missing are expected to report nothing (they exit or are killed); their entry is
    ("exit", exitcode). clean_exit: children exit through the interpreter's finalization (destructors
    run) after reporting; otherwise with os._exit."""
    ctx = _PROCESSES
    results = ctx.Queue()
    child_env = {"PYTHONPATH": os.pathsep.join(([] if INSTALLED else [PYTHON_DIR, ALIAS_DIR]) + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="moe-ep-pytest-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)  # the children start with it (and set it again themselves)
        try:
            call = pickle.dumps((fn, args))
            procs = [ctx.Process(target=process_child.child, args=(r, n, init_file, call, child_env, results, clean_exit),
                                 daemon=True)
                     for r in range(n)]
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out = {}
        deadline = time.monotonic() + timeout
        want = n - len(expect_missing)
        try:
            while len(out) < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                    out[rank] = (status, value)
                except queue_mod.Empty:
                    if all(not p.is_alive() for p in procs):
                        # one last drain: a child may have exited right after putting
                        try:
                            while True:
                                rank, status, value = results.get(timeout=0.5)
                                out[rank] = (status, value)
                        except queue_mod.Empty:
                            break
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(20.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        for r, p in enumerate(procs):
            if r not in out:
                out[r] = ("exit", p.exitcode)
        return out


def check_all_ok(out):
    """Fails with every child's traceback unless every rank returned; returns results by rank."""
    bad = {r: v for r, v in out.items() if v[0] != "ok"}
    if bad:
        lines = []
        for r, (status, value) in sorted(bad.items()):
            if status == "error":
                lines.append(f"--- rank {r}: {value['type']}: {value['message']}\n{value['traceback']}")
            else:
                lines.append(f"--- rank {r}: no report (exit code {value})")
        pytest.fail("child processes failed:\n" + "\n".join(lines), pytrace=False)
    return [out[r][1] for r in sorted(out)]


def local_world(n, fn, num_scaleout=1):
    return moe_ep.LocalWorld(n, num_scaleout).run(fn)


def shm_listing():
    """/dev/shm's entries under moe-ep's names: the only ones a test of moe-ep can call its own
    (other programs, and the tests running beside this one, create and remove theirs meanwhile)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith(("moe-ep", "moe_ep"))}
    except FileNotFoundError:
        return set()


@pytest.fixture
def shm_unchanged():
    """Asserts that the test leaves no new entry under moe-ep's names in /dev/shm."""
    before = shm_listing()
    yield
    time.sleep(0.2)
    leaked = shm_listing() - before
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and the CUDA provider (skipped, with the reason, "
                                       "without them)")
