"""ElasticBuffer's Engram storage, PP send/receive and barrier through DeepEP's API
(docs/engram-pp.md): signatures and size hints, fetches against torch indexing of the written
tables (scenarios/engram_pp.py), PP rings against the tensors sent, on ranks as threads (one node
and two logical nodes) and in processes, and every refusal with its type and message."""

import inspect
import threading

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

from conftest import check_all_ok, run_processes
from scenarios import engram_pp

MiB2 = 2 << 20


def params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


E = inspect.Parameter.empty


def test_signatures_are_deepeps():
    B = deep_ep.ElasticBuffer
    assert params(B.engram_write) == [("self", E), ("storage", E), ("sf", None)]
    assert params(B.engram_fetch) == [("self", E), ("indices", E), ("num_qps", 0),
                                      ("use_tma_aligned_col_major_sf", False)]
    assert params(B.pp_set_config) == [("self", E), ("num_max_tensor_bytes", E), ("num_max_inflight_tensors", E)]
    assert params(B.pp_send) == [("self", E), ("t", E), ("dst_rank_idx", E), ("num_sms", 0)]
    assert params(B.pp_recv) == [("self", E), ("t", E), ("src_rank_idx", E), ("num_sms", 0)]
    assert params(B.barrier) == [("self", E), ("use_comm_stream", True), ("with_cpu_sync", False),
                                 ("sequential", True)]
    for name in ("get_engram_storage_size_hint", "get_pp_buffer_size_hint"):
        assert isinstance(inspect.getattr_static(B, name), staticmethod), name
    assert params(B.get_engram_storage_size_hint) == [("num_entries", E), ("hidden", E),
                                                      ("num_max_tokens_per_rank", E), ("dtype", torch.bfloat16)]
    assert params(B.get_pp_buffer_size_hint) == [("num_max_tensor_bytes", E), ("num_max_inflight_tensors", E)]


def _up(x, a):
    return (x + a - 1) // a * a


@pytest.mark.parametrize("entries,hidden,rows,dtype", [(1000, 7168, 4096, torch.bfloat16),
                                                       (3, 100, 5, torch.float8_e4m3fn), (0, 1, 0, torch.float32)])
def test_engram_size_hint(entries, hidden, rows, dtype):
    per = _up(hidden * torch.empty((), dtype=dtype).element_size(), 32)
    assert deep_ep.ElasticBuffer.get_engram_storage_size_hint(entries, hidden, rows, dtype) == (
        _up(per * rows, MiB2), _up(per * entries, MiB2))


@pytest.mark.parametrize("nbytes,inflight", [(4096 * 7168 * 2, 4), (1, 1), (33, 3)])
def test_pp_size_hint(nbytes, inflight):
    assert deep_ep.ElasticBuffer.get_pp_buffer_size_hint(nbytes, inflight) == _up(_up(nbytes, 32) * inflight * 4, MiB2)


def test_size_hints_refuse_negative_sizes():
    with pytest.raises(moe_ep.InvalidArgument, match="num_entries = -1"):
        deep_ep.ElasticBuffer.get_engram_storage_size_hint(-1, 8, 8)
    with pytest.raises(moe_ep.InvalidArgument, match="num_max_inflight_tensors = -2 must not be negative"):
        deep_ep.ElasticBuffer.get_pp_buffer_size_hint(64, -2)


WORLDS = [(2, 1), (4, 1), (4, 2)]
VARIANTS = {"bf16": dict(fp8=False), "fp8_f32": dict(fp8=True, sf_dtype=torch.float32),
            "fp8_i32": dict(fp8=True, sf_dtype=torch.int32)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("ranks,nodes", WORLDS)
def test_engram_fetch_threads(ranks, nodes, variant):
    out = moe_ep.LocalWorld(ranks, nodes).run(lambda g: engram_pp.engram(g, deep_ep, 11 + ranks, **VARIANTS[variant]))
    assert len(out) == ranks and all(o > 0 for o in out)


@pytest.mark.parametrize("ranks,nodes", [(1, 1)] + WORLDS)
def test_pp_ring_threads(ranks, nodes):
    out = moe_ep.LocalWorld(ranks, nodes).run(lambda g: engram_pp.pp_ring(g, deep_ep, 5 + ranks))
    # every event is one send and one receive
    assert sum(s for s, _ in out) == sum(r for _, r in out) == 96


def _both_over_processes(rank, world, group):
    return engram_pp.engram(group, deep_ep, 21, fp8=True), engram_pp.pp_ring(group, deep_ep, 22, events=64)


@pytest.mark.parametrize("ranks_per_node", ["0", "2"])
def test_engram_and_pp_over_processes(ranks_per_node):
    out = check_all_ok(run_processes(_both_over_processes, 4, env={"MOE_EP_RANKS_PER_NODE": ranks_per_node}))
    assert sum(pp[0] for _, pp in out) == 64


def test_pp_to_itself_with_one_rank():
    def fn(g):
        buf = deep_ep.ElasticBuffer(g, num_bytes=MiB2)
        buf.pp_set_config(64, 2)
        sent = [torch.full((8,), float(i)) for i in range(2)]
        for t in sent:
            buf.pp_send(t, 0)
        with pytest.raises(moe_ep.StateError, match="receive buffer full: 2 messages to rank 0 .this rank."):
            buf.pp_send(sent[0], 0)
        for t in sent:
            got = torch.empty(8)
            buf.pp_recv(got, 0)
            assert torch.equal(got, t)
        with pytest.raises(moe_ep.StateError, match="receive buffer empty"):
            buf.pp_recv(torch.empty(8), 0)
        return True
    assert moe_ep.LocalWorld(1).run(fn) == [True]


@pytest.mark.parametrize("ranks,nodes", [(2, 1), (4, 2)])
def test_barrier_with_every_flag_combination(ranks, nodes):
    arrived = []
    lock = threading.Lock()

    def fn(g):
        buf = deep_ep.ElasticBuffer(g, num_bytes=MiB2)
        seen = []
        for i in range(8):
            with lock:
                arrived.append((i, g.rank()))
            buf.barrier(use_comm_stream=bool(i & 1), with_cpu_sync=bool(i & 2), sequential=bool(i & 4))
            with lock:  # every rank arrived at barrier i before any left it
                seen.append(sum(1 for j, _ in arrived if j == i))
        return seen
    assert moe_ep.LocalWorld(ranks, nodes).run(fn) == [[ranks] * 8] * ranks


# ---- refusals -------------------------------------------------------------------------------------


def _errors(ranks, fn, nodes=1):
    """fn(g, buf-less) -> what each rank caught: (type name, message, ranks)."""
    def run(g):
        try:
            fn(g)
            return None
        except moe_ep.Error as e:
            return type(e).__name__, str(e), list(getattr(e, "ranks", []) or [])
        except TypeError as e:
            return "TypeError", str(e), []
    return moe_ep.LocalWorld(ranks, nodes).run(run)


def _engram_buffer(g, **kw):
    return deep_ep.ElasticBuffer(g, num_bytes=2 * MiB2, num_cpu_bytes=MiB2, **kw)


def test_fetch_refusals():
    def fn(g):
        buf = _engram_buffer(g)
        idx = torch.zeros(2, 3, dtype=torch.int32)
        with pytest.raises(moe_ep.StateError, match=r"\[rank \d\] engram_fetch: nothing to fetch"):
            buf.engram_fetch(idx)
        buf.engram_write(torch.ones(5, 64, dtype=torch.bfloat16))
        idx[1, 2] = 20
        with pytest.raises(moe_ep.InvalidArgument,
                           match=r"indices\[1, 2\] = 20 is outside \[0, num_ranks \* num_entries = 4 \* 5 = 20\)"):
            buf.engram_fetch(idx)
        idx[1, 2] = -1
        with pytest.raises(moe_ep.InvalidArgument, match=r"indices\[1, 2\] = -1 is outside"):
            buf.engram_fetch(idx)
        with pytest.raises(moe_ep.InvalidArgument, match="indices"):
            buf.engram_fetch(torch.zeros(2, 3, dtype=torch.int64))
        with pytest.raises(moe_ep.InvalidArgument, match=r"num_qps = -1 is outside"):
            buf.engram_fetch(torch.zeros(2, 3, dtype=torch.int32), num_qps=-1)
        big = torch.zeros(20000, 20, dtype=torch.int32)  # 400000 rows x 128 bytes > the 2 MiB pool
        with pytest.raises(moe_ep.CapacityError, match="more than the 2097152 bytes of the buffer's pool"):
            buf.engram_fetch(big)
        return True
    assert moe_ep.LocalWorld(4).run(fn) == [True] * 4


def test_write_refusals_reach_every_rank():
    # num_cpu_bytes == 0: every rank refuses its own write.
    out = _errors(2, lambda g: deep_ep.ElasticBuffer(g, num_bytes=MiB2).engram_write(
        torch.ones(4, 8, dtype=torch.bfloat16)))
    assert all(o[0] == "InvalidArgument" and "num_cpu_bytes = 0" in o[1] for o in out), out
    # Shapes that differ between ranks: every rank raises PeerError naming the field and who holds what.
    out = _errors(3, lambda g: _engram_buffer(g).engram_write(torch.ones(4, 8 + 8 * (g.rank() == 2),
                                                                         dtype=torch.bfloat16)))
    for o in out:
        assert o[0] == "PeerError" and "ranks disagree on hidden (storage.size(1)): 16 on rank [2], 8 on ranks [0, 1]" \
            in o[1], o
    # One rank's bad storage: it raises its own error, the others PeerError naming it.
    out = _errors(2, lambda g: _engram_buffer(g).engram_write(
        torch.ones(4, 8, dtype=torch.float32 if g.rank() == 1 else torch.bfloat16)))
    assert out[1][0] == "InvalidArgument" and "storage has dtype float32" in out[1][1], out
    assert out[0][0] == "PeerError" and out[0][2] == [1], out
    # A storage the extension cannot convert: TypeError there, PeerError elsewhere.
    out = _errors(2, lambda g: _engram_buffer(g).engram_write(torch.ones(4, 8, dtype=torch.bfloat16)
                                                              if g.rank() == 0 else [1, 2]))
    assert out[1][0] == "TypeError" and out[0][0] == "PeerError" and out[0][2] == [1], out
    # FP8 without scales, more bytes than num_cpu_bytes, scales of the wrong shape.
    fp8 = torch.zeros(4, 8, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for storage, sf, fragment in [(fp8, None, "so sf (its scales"),
                                  (torch.ones(2, 2 ** 20, dtype=torch.bfloat16), None, "more than num_cpu_bytes"),
                                  (fp8, torch.ones(4, 2), "sf has shape [4, 2]; expected [num_ranks * num_entries"),
                                  (torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 2), "scales go with")]:
        out = _errors(2, lambda g: _engram_buffer(g).engram_write(storage, sf))
        assert all(fragment in o[1] for o in out), (fragment, out)


def test_constructor_rules_of_num_cpu_bytes():
    for kw, fragment in [(dict(num_cpu_bytes=MiB2, num_max_tokens_per_rank=8, hidden=128), "num_bytes is required"),
                         (dict(num_bytes=MiB2, num_cpu_bytes=2 * MiB2), "num_cpu_bytes = 4194304 exceeds num_bytes"),
                         (dict(num_bytes=2 * MiB2, num_cpu_bytes=100), "num_cpu_bytes = 100 is not a multiple")]:
        out = _errors(2, lambda g: deep_ep.ElasticBuffer(g, **kw))
        assert all(o[0] == "InvalidArgument" and fragment in o[1] for o in out), out
    buf_bytes = moe_ep.LocalWorld(1).run(lambda g: _engram_buffer(g).num_bytes)
    assert buf_bytes == [2 * MiB2]  # the total, as given


def test_pp_refusals():
    def fn(g):
        buf = deep_ep.ElasticBuffer(g, num_bytes=MiB2)
        r, nxt, prv = g.rank(), (g.rank() + 1) % 4, (g.rank() + 3) % 4
        with pytest.raises(moe_ep.StateError, match="call pp_set_config first"):
            buf.pp_send(torch.zeros(8), nxt)
        buf.pp_set_config(100, 2)  # messages up to 128 bytes
        with pytest.raises(moe_ep.InvalidArgument,
                           match=f"dst_rank_idx = {(r + 2) % 4} is not a ring neighbour of rank {r}: .* prev = {prv} "
                                 f"or next = {nxt}"):
            buf.pp_send(torch.zeros(8), (r + 2) % 4)
        with pytest.raises(moe_ep.CapacityError, match=r"has 160 bytes, more than num_max_tensor_bytes rounded up to "
                                                       r"32 = 128"):
            buf.pp_send(torch.zeros(40), nxt)
        with pytest.raises(moe_ep.InvalidArgument, match="has 36 bytes, not a multiple of 32"):
            buf.pp_send(torch.zeros(9), nxt)
        with pytest.raises(moe_ep.InvalidArgument, match="t must be contiguous|contiguous"):
            buf.pp_send(torch.zeros(8, 2).t(), nxt)
        with pytest.raises(moe_ep.InvalidArgument, match="num_sms = -1"):
            buf.pp_send(torch.zeros(8), nxt, num_sms=-1)
        buf.pp_send(torch.arange(8, dtype=torch.float32) + r, nxt)
        with pytest.raises(moe_ep.InvalidArgument, match=f"the next message from rank {prv} has 32 bytes, but t .* has "
                                                         "64 bytes .the message stays queued."):
            buf.pp_recv(torch.zeros(16), prv)
        got = torch.zeros(8)
        buf.pp_recv(got, prv)
        assert torch.equal(got, torch.arange(8, dtype=torch.float32) + prv)
        return True
    assert moe_ep.LocalWorld(4).run(fn) == [True] * 4


def test_pp_set_config_refusals_reach_every_rank():
    out = _errors(2, lambda g: deep_ep.ElasticBuffer(g, num_bytes=MiB2).pp_set_config(64 if g.rank() else 0, 2))
    assert out[0][0] == "InvalidArgument" and "num_max_tensor_bytes = 0" in out[0][1], out
    assert out[1][0] == "PeerError" and out[1][2] == [0], out
    out = _errors(2, lambda g: deep_ep.ElasticBuffer(g, num_bytes=MiB2).pp_set_config(MiB2 // 4, 2))
    assert all("* 4 = 524288 * 2 * 4 = 4194304 exceeds num_bytes = 2097152" in o[1] for o in out), out
    out = _errors(2, lambda g: deep_ep.ElasticBuffer(g, num_bytes=MiB2).pp_set_config(64, 2 + g.rank()))
    assert all(o[0] == "PeerError" and "ranks disagree on num_max_inflight_tensors" in o[1] for o in out), out
    out = _errors(2, lambda g: deep_ep.ElasticBuffer(g, num_bytes=MiB2).pp_set_config(64, "2" if g.rank() else 2))
    assert out[1][0] == "TypeError" and out[0][0] == "PeerError", out

    def unreceived(g):
        buf = deep_ep.ElasticBuffer(g, num_bytes=MiB2)
        buf.pp_set_config(64, 2)
        if g.rank() == 0:
            buf.pp_send(torch.zeros(8), 1)
        buf.pp_set_config(128, 2)
    out = _errors(2, unreceived)
    assert all(o[0] == "StateError" and "1 message(s) from rank 0 to rank 1 are not received yet" in o[1]
               for o in out), out


@pytest.mark.parametrize("side", ["recv", "send"])
def test_pp_timeouts_name_the_peer(side):
    done = threading.Event()

    def fn(g):
        buf = deep_ep.ElasticBuffer(g, num_bytes=MiB2, num_cpu_timeout_secs=2.0)
        buf.pp_set_config(64, 1)
        caught = None
        if g.rank() == 0:
            try:
                if side == "recv":
                    buf.pp_recv(torch.zeros(8), 1)
                else:
                    buf.pp_send(torch.zeros(8), 1)
                    buf.pp_send(torch.zeros(8), 1)
            except moe_ep.TimeoutError as e:
                caught = (list(e.ranks), str(e))
            with pytest.raises(moe_ep.StateError, match="PP channels were closed"):
                buf.pp_send(torch.zeros(8), 1)
            done.set()
        else:
            done.wait(60)
        buf.barrier()  # the buffer stays usable
        return caught
    out = moe_ep.LocalWorld(2).run(fn)
    ranks, msg = out[0]
    assert ranks == [1], out
    want = "pp_recv: receive buffer empty (no message from rank 1)" if side == "recv" else \
        "pp_send: send: receive buffer full (rank 1 has not received 1 messages from rank 0)"
    assert want in msg, msg

