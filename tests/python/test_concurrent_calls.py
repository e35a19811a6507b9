"""Two Python threads per rank calling one buffer at once (docs/semantics.md, "Concurrent calls"), on
LocalWorld(2): the calls of a buffer are serialised, and the extension releases the GIL wherever a
call may wait for the buffer. Free-running threads get the references' results or the PeerError of
ranks that disagree; threads taking turns in the same order on every rank get the references'
results with inputs of their own, V1 receive hooks run on yet another thread, and the dispatcher's
Python hooks run while other threads ask the cache for its statistics. HybridEPBuffer's identical
dispatches from both threads all match its reference."""

import threading

import torch

import moe_ep
from moe_ep import deep_ep

import reference as ref
from scenarios import assert_same
from scenarios.v1_low_latency import check_ll_dispatch
from scenarios.v2 import _check_compact_rows, _combine_compact
from test_dispatcher import CAP as DISPATCH_CAP, E as DISPATCH_E, H as DISPATCH_H, K as DISPATCH_K, PREFILL, check_round
from test_hybrid_ep import Case, check_dispatch, everything, inputs as hybrid_inputs

H, E, K, T, TOKENS = 128, 8, 3, 8, 6
THREADS = 2


def run_threads(rounds, body, take_turns):
    """Runs body(thread, round) on THREADS threads, `rounds` rounds each; with take_turns thread t
    makes rounds at turns t, t + THREADS, ... Returns what the rounds raised, as text."""
    turn, changed, problems = [0], threading.Condition(), []

    def thread(t):
        for r in range(rounds):
            if take_turns:
                with changed:
                    changed.wait_for(lambda: turn[0] == r * THREADS + t)
            try:
                body(t, r)
            except Exception as e:  # every failure is reported, with the thread and the round
                problems.append(f"thread {t} round {r}: {type(e).__name__}: {e}")
            if take_turns:
                with changed:
                    turn[0] += 1
                    changed.notify_all()

    started = [threading.Thread(target=thread, args=(t,)) for t in range(THREADS)]
    for s in started:
        s.start()
    for s in started:
        s.join()
    return problems


def disagreement(error):
    return isinstance(error, moe_ep.PeerError) and "disagree" in str(error)


def v2_dispatch(buf, inputs, rank):
    x, idx, w = inputs[rank]
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    exp = ref.v2_dispatch_compact(inputs, rank, E)
    m = len(exp["rows"])
    _check_compact_rows(recv_x, recv_idx, recv_w, exp, None, m, H, K, True)
    return handle, recv_x, recv_w, m


def v2_combine(buf, inputs, rank, dispatched):
    handle, recv_x, recv_w, m = dispatched
    _combine_compact(buf, handle, recv_x, recv_w, inputs, rank, E, m, m, True, True, False, None)


def elastic_buffer(g):
    return deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)


def test_elastic_buffer_free_running_threads():
    def rank_fn(g):
        rank, buf = g.rank(), elastic_buffer(g)
        inputs = ref.make_inputs(g.size(), TOKENS, H, E, K, seed=5)
        held = [None] * THREADS

        def body(t, _):
            try:
                if held[t] is None:
                    held[t] = v2_dispatch(buf, inputs, rank)
                else:
                    dispatched, held[t] = held[t], None
                    v2_combine(buf, inputs, rank, dispatched)
            except moe_ep.PeerError as e:
                if not disagreement(e):
                    raise

        problems = run_threads(40, body, take_turns=False)
        v2_combine(buf, inputs, rank, v2_dispatch(buf, inputs, rank))  # still usable
        buf.destroy()
        return problems

    assert moe_ep.LocalWorld(2).run(rank_fn) == [[], []]


def test_elastic_buffer_threads_taking_turns_with_inputs_of_their_own():
    def rank_fn(g):
        rank, buf = g.rank(), elastic_buffer(g)
        inputs = [ref.make_inputs(g.size(), TOKENS, H, E, K, seed=10 + t) for t in range(THREADS)]
        problems = run_threads(10, lambda t, _: v2_combine(buf, inputs[t], rank, v2_dispatch(buf, inputs[t], rank)),
                               take_turns=True)
        buf.destroy()
        return problems

    assert moe_ep.LocalWorld(2).run(rank_fn) == [[], []]


def test_v1_low_latency_hooks_called_from_another_thread():
    def rank_fn(g):
        rank, R, El = g.rank(), g.size(), E // g.size()
        buf = deep_ep.Buffer(g, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                             low_latency_mode=True, explicitly_destroy=True)
        inputs = [ref.make_inputs(R, TOKENS, H, E, K, seed=20 + t) for t in range(THREADS)]

        def body(t, _):
            x, idx, w = inputs[t][rank]
            recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False,
                                                                      return_recv_hook=True)
            receiver = threading.Thread(target=hook)
            receiver.start()
            receiver.join()
            slab_rows = check_ll_dispatch(inputs[t], rank, E, T, recv_x, count, handle)
            y = torch.zeros(El, R * T, H, dtype=torch.bfloat16)
            for i in range(El):
                for r, (s, tok) in enumerate(slab_rows[i]):
                    y[i, r] = ref.expert_transform(inputs[t][s][0][tok], rank * El + i)
            combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
            exp = ref.ll_combine(inputs[t], rank, E, lambda tok, e: ref.expert_transform(x[tok], e))
            assert_same(combined, exp, "low-latency combined_x")

        problems = run_threads(8, body, take_turns=True)
        buf.destroy()
        return problems

    assert moe_ep.LocalWorld(2).run(rank_fn) == [[], []]


def test_dispatcher_hooks_run_while_other_threads_read_the_cache():
    def rank_fn(g):
        cache = moe_ep.BufferCache(g)
        layers = [moe_ep.TokenDispatcher(cache, DISPATCH_H, DISPATCH_E, DISPATCH_K,
                                         num_max_dispatch_tokens_per_rank=DISPATCH_CAP,
                                         num_max_prefill_tokens_per_rank=PREFILL) for _ in range(THREADS)]
        hooked, done = [], threading.Event()
        for d in layers:
            d.add_hook("after_dispatch_a", lambda info: hooked.append(info["micro_batch"]))

        def reader():
            while not done.is_set():
                cache.stats()

        watcher = threading.Thread(target=reader)
        watcher.start()
        problems = run_threads(6, lambda t, r: check_round(g, layers[t], "prefill", 30 + t, "normal"), take_turns=True)
        done.set()
        watcher.join()
        if len(hooked) != THREADS * 6:
            problems.append(f"{len(hooked)} hook calls, expected {THREADS * 6}")
        return problems

    assert moe_ep.LocalWorld(2).run(rank_fn) == [[], []]


def test_hybrid_ep_identical_dispatches_from_two_threads():
    case = Case(2, 1)

    def rank_fn(g):
        me = g.rank()
        buf = deep_ep.HybridEPBuffer(g, hidden_dim=case.H, max_num_of_tokens_per_rank=16, num_local_experts=2)
        x, _, routing_map, probs = hybrid_inputs(case, me)
        everything_ = everything(case)

        def body(t, r):
            bad = []
            check_dispatch(case, me, everything_, buf.dispatch(hidden=x, routing_map=routing_map, probs=probs), bad)
            assert not bad, bad

        return run_threads(15, body, take_turns=False)

    assert moe_ep.LocalWorld(2).run(rank_fn) == [[], []]


def test_buffers_freed_on_another_ranks_thread():
    """Python's garbage collector runs a buffer's destructor on whichever thread triggers it; with
    ranks as threads that can be another rank's thread. Here rank 1's thread drops both ranks'
    buffers, rank 0's first. The destructor of rank 0's buffer, running on rank 1's thread, cannot
    wait there for rank 1's part of the destruction (rank 1 is that very thread; with a 600 s
    timeout the test would hang): it leaves the buffers' channel, and rank 1's own destruction then
    finds rank 0 gone at once (rank 0 meanwhile waits for rank 1 in the group's all-gather).
    Both ranks then build new buffers, whose dispatch and combine match the reference."""
    held = {}

    def rank_fn(g):
        rank = g.rank()
        held[rank] = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                           num_cpu_timeout_secs=600)
        g.all_gather_bytes(b"")  # both buffers exist
        if rank == 1:
            del held[0]  # rank 0's destructor, on this thread: it leaves the buffers' channel
            del held[1]  # rank 1's: its destruction finds rank 0 gone
        g.all_gather_bytes(b"")  # both are gone
        buf = elastic_buffer(g)
        inputs = ref.make_inputs(g.size(), TOKENS, H, E, K, seed=9)
        v2_combine(buf, inputs, rank, v2_dispatch(buf, inputs, rank))
        buf.destroy()
        return len(held)

    assert moe_ep.LocalWorld(2).run(rank_fn) == [0, 0]
