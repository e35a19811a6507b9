"""Failures between processes: a process that exits or is killed before a collective makes every
other process raise moe_ep.PeerError naming it at once (never its subclass TimeoutError: the
liveness check finds the process gone); a process that stays but never arrives is a TimeoutError
naming it; nothing stays in /dev/shm, and no moe-ep memfd stays referenced once the survivors
dropped their buffers. Only the error type, ranks and reason are asserted, never how long anything
took."""

import gc
import os
import signal
import time

import pytest

from conftest import check_all_ok, run_processes

H, E, K, T, N = 256, 12, 2, 16, 8
TIMEOUT = "20"


def memfd_refs():
    """moe-ep memfds this process holds: open descriptors and mappings."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("memfd:moe-ep"):
            fds.append(target)
    with open("/proc/self/maps") as f:
        maps = [line.split(None, 5)[-1].strip() for line in f if "memfd:moe-ep" in line]
    return fds, maps


def _make(kind, group):
    import moe_ep.deep_ep as deep_ep
    if kind == "v2":
        return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                     num_cpu_timeout_secs=float(TIMEOUT))
    return deep_ep.Buffer(group, 1 << 20, 0)


def _call(kind, buf, rank, world):
    import reference as ref
    x, idx, w = ref.make_inputs(world, N, H, E, K, 1)[rank]
    if kind == "v2":
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=w)


def _dies(rank, world, group, kind, victim, how):
    import moe_ep
    buf = _make(kind, group)
    _call(kind, buf, rank, world)  # one good round first: everything is mapped
    alive = memfd_refs()
    if rank == victim:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        _call(kind, buf, rank, world)
        got = ("no error", [], "")
    except moe_ep.PeerError as e:
        got = (type(e).__name__, list(e.ranks), str(e))
    del buf
    moe_ep._groups.forget_group(group)
    gc.collect()
    time.sleep(0.2)
    return {"error": got, "alive": alive, "after": memfd_refs()}


@pytest.mark.parametrize("kind", ["v2", "v1"])
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_dead_peer_is_named(kind, how, shm_unchanged):
    world, victim = 3, 2
    env = {"MOE_EP_TIMEOUT_SECS": TIMEOUT, "MOE_EP_ALLOCATOR_CACHE_BYTES": "0"}
    out = run_processes(_dies, world, args=(kind, victim, how), env=env, expect_missing=(victim,), clean_exit=False)
    assert out[victim][0] == "exit" and out[victim][1] in ((3,) if how == "exit" else (-signal.SIGKILL,))
    survivors = {r: v for r, v in out.items() if r != victim}
    check_all_ok(survivors)
    for r, (_, res) in survivors.items():
        name, ranks, msg = res["error"]
        # At once, not after the timeout (docs/host.md, "Liveness and failures"): a PeerError that
        # is not a TimeoutError, naming the dead rank alone, with the reason the docs quote (also
        # when this rank learnt it from the other survivor, whose reason it quotes).
        assert name == "PeerError", f"rank {r}: {res['error']}"
        assert ranks == [victim], f"rank {r}: {name}.ranks = {ranks} ({msg})"
        assert f"rank {victim} is gone (its process" in msg, f"rank {r}: {msg}"
        fds, maps = res["alive"]
        assert fds or maps, "while the buffer lived, the process held moe-ep memfds (the check below can see them)"
        assert res["after"] == ([], []), f"rank {r} still references moe-ep memfds: {res['after']}"
    # and the parent never holds any
    assert memfd_refs() == ([], [])


def _absent(rank, world, group, flag):
    import moe_ep
    import moe_ep.deep_ep as deep_ep
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, num_cpu_timeout_secs=2.0)
    if rank == 1:
        # never calls: waits until rank 0 has reported, then leaves
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    try:
        _call("v2", buf, rank, world)
        got = ("no error", [], "")
    except moe_ep.PeerError as e:
        got = (type(e).__name__, list(e.ranks), str(e))
    with open(flag, "w") as f:
        f.write("done")
    return got


def test_absent_peer_is_timeout_error(tmp_path, shm_unchanged):
    out = run_processes(_absent, 2, args=(str(tmp_path / "flag"),), expect_missing=(1,), clean_exit=False)
    name, ranks, msg = check_all_ok({0: out[0]})[0]
    assert name == "TimeoutError", msg
    assert ranks == [1], msg


def _normal(rank, world, group):
    import scenarios
    import moe_ep.deep_ep as deep_ep
    scenarios.v2_compact(group, deep_ep, seed=3)
    scenarios.v1_low_latency(group, deep_ep, seed=4)
    return memfd_refs()


def test_normal_run_leaves_nothing(shm_unchanged):
    check_all_ok(run_processes(_normal, 2))
