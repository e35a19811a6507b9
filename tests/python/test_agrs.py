"""ElasticBuffer's all-gather sessions (DeepEP V2's AGRS; docs/agrs.md): random batches of
all_gather calls (batched and single, in place and not) over rotated sessions, on ranks as threads
and as processes, against torch.stack of every rank's inputs (each rank regenerates every rank's
inputs from their seeds); the size hints against their formulas; and every misuse a typed error on
every rank, with nothing left waiting."""

import inspect
import random

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

from conftest import check_all_ok, run_processes

SHAPES = [(8, 16), (3, 5, 7), (64,), (2, 32), (1,), (0, 4)]
DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.int16, torch.bool]
MAX_CALLS = 4  # all_gather calls per session (Q)
TIMEOUT = 30


# DeepEP V2's names, parameters and defaults (deepep-v2-extras.md §8-§12).
METHODS = {
    "agrs_set_config": [("self", None), ("num_max_session_bytes", None), ("num_max_all_gathers_per_session", None)],
    "create_agrs_session": [("self", None)],
    "destroy_agrs_session": [("self", None)],
    "agrs_new_session": [("self", None), ("enabled", True)],
    "agrs_get_inplace_tensor": [("self", None), ("shapes", None), ("dtype", None)],
    "all_gather": [("self", None), ("t", None)],
}
STATIC = {
    "get_agrs_num_max_session_bytes": [("group", None), ("shapes", None), ("dtype", None)],
    "get_agrs_buffer_size_hint": [("group", None), ("num_max_session_bytes", None)],
}


def test_signatures():
    def params(fn):
        return [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                for p in inspect.signature(fn).parameters.values()]
    for name, want in METHODS.items():
        assert params(getattr(deep_ep.ElasticBuffer, name)) == want, name
    for name, want in STATIC.items():
        assert isinstance(inspect.getattr_static(deep_ep.ElasticBuffer, name), staticmethod), name
        assert params(getattr(deep_ep.ElasticBuffer, name)) == want, name
    assert not hasattr(deep_ep.ElasticBuffer, "reduce_scatter")  # DeepEP has none


def align(x, to):
    return (x + to - 1) // to * to


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def nbytes(shape, dtype):
    return numel(shape) * torch.empty((), dtype=dtype).element_size()


def block(shape, dtype, ranks):
    """DeepEP's block of one input in a session: a(R * bytes, 32)."""
    return align(ranks * nbytes(shape, dtype), 32)


def make(shape, dtype, seed):
    """The input a rank gives: a pure function of its seed, so every rank can rebuild every rank's."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low, high = (0, 256) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def seed_of(seed, session, call, item, rank):
    return ((seed * 1009 + session) * 101 + call) * 1013 + item * 31 + rank


def make_plan(seed, sessions):
    """Per session, the calls (batched, dtype, shapes, in place per item) and the handle order;
    the same on every rank."""
    rng = random.Random(seed)
    plan = []
    for _ in range(sessions):
        calls = []
        for _ in range(rng.randint(1, MAX_CALLS)):
            batched = rng.random() < 0.8
            count = rng.randint(1, 3) if batched else 1
            shapes = [rng.choice(SHAPES) for _ in range(count)]
            calls.append((batched, rng.choice(DTYPES), shapes, [rng.random() < 0.5 for _ in range(count)]))
        plan.append((calls, rng.sample(range(len(calls)), len(calls))))
    return plan


def session_bytes(plan, ranks):
    """The largest session of the plan, by the formula."""
    return max(sum(block(s, dtype, ranks) for _, dtype, shapes, _ in calls for s in shapes) for calls, _ in plan)


def gather_call(buf, rank, seed, s, c, call):
    """One all_gather of the plan: its results (a list) and handle, and where in-place inputs were."""
    batched, dtype, shapes, in_place = call
    inputs = [make(shape, dtype, seed_of(seed, s, c, i, rank)) for i, shape in enumerate(shapes)]
    args, places = list(inputs), [None] * len(shapes)
    if any(in_place):
        got = buf.agrs_get_inplace_tensor([tuple(x) for x in shapes] if batched else shapes[0], dtype)
        got = got if batched else (got,)
        assert isinstance(got, tuple) and len(got) == len(shapes)
        for i, place in enumerate(got):
            assert place.shape == shapes[i] and place.dtype == dtype
            if in_place[i]:
                place.copy_(inputs[i])
                args[i], places[i] = place, place
    if batched:
        *gathered, handle = buf.all_gather(tuple(args) if c % 2 else args)
    else:
        one, handle = buf.all_gather(args[0])
        gathered = [one]
    assert len(gathered) == len(shapes) and callable(handle)
    return gathered, handle, places


def run_plan(buf, ranks, rank, seed, plan):
    """Runs the plan on this rank; returns the problems found (empty: all results right)."""
    problems = []
    for s, (calls, order) in enumerate(plan):
        with buf.agrs_new_session():
            results, handles = [], []
            for c, call in enumerate(calls):
                gathered, handle, places = gather_call(buf, rank, seed, s, c, call)
                for i, out in enumerate(gathered):
                    if places[i] is not None and places[i].numel() and out[rank].data_ptr() != places[i].data_ptr():
                        problems.append(f"session {s} call {c} input {i}: the in-place input is not row {rank}")
                results.append(gathered)
                handles.append(handle)
            for k in order:  # in a random order, inside the session
                handles[k]()
            # Cloned at the end of the session: later calls of the session left earlier results alone.
            cloned = [[g.clone() for g in gathered] for gathered in results]
        for c, (_, dtype, shapes, _) in enumerate(calls):
            for i, shape in enumerate(shapes):
                want = torch.stack([make(shape, dtype, seed_of(seed, s, c, i, j)) for j in range(ranks)])
                got = cloned[c][i]
                if got.dtype != dtype or got.shape != (ranks, *shape) or not torch.equal(got, want):
                    problems.append(f"session {s} call {c} input {i}: {got.dtype}{tuple(got.shape)} differs from "
                                    f"the stacked inputs {want.dtype}{tuple(want.shape)}")
    return problems


def plan_on(group, ranks, rank, seed, sessions, exact):
    """A buffer sized as DeepEP's test sizes it (the hint as num_bytes and as the session bytes),
    or to the plan's exact session bytes; then the plan."""
    plan = make_plan(seed, sessions)
    exact_bytes = session_bytes(plan, ranks)
    hint = deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, exact_bytes)
    assert hint == align(exact_bytes, 2 ** 21)
    buf = deep_ep.ElasticBuffer(group, num_bytes=hint, explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT)
    buf.agrs_set_config(exact_bytes if exact else hint, MAX_CALLS)
    problems = run_plan(buf, ranks, rank, seed, plan)
    buf.destroy()
    return problems


@pytest.mark.parametrize("ranks,exact", [(2, True), (4, False), (8, False)])
def test_random_sessions_threads(ranks, exact):
    def fn(g):
        return plan_on(g, g.size(), g.rank(), seed=7 + ranks, sessions=4, exact=exact)
    assert moe_ep.LocalWorld(ranks).run(fn) == [[]] * ranks


def _plan_in_process(rank, world, group, seed):
    return plan_on(group, world, rank, seed, sessions=3, exact=True)


@pytest.mark.parametrize("ranks", [2, 4])
def test_random_sessions_processes(ranks):
    assert check_all_ok(run_processes(_plan_in_process, ranks, args=(30 + ranks,))) == [[]] * ranks


def test_size_hints():
    def fn(g):
        R = g.size()
        shapes = [torch.Size([32, 64, 20]), (7,), (3, 0), ()]
        for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.int64):
            want = sum(align(R * numel(s) * torch.empty((), dtype=dtype).element_size(), 32) for s in shapes)
            assert deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(g, shapes, dtype) == want
            # one shape (a tuple of ints, or a torch.Size) is not a sequence of shapes
            one = align(R * 32 * 64 * 20 * torch.empty((), dtype=dtype).element_size(), 32)
            assert deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(g, (32, 64, 20), dtype) == one
            assert deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(g, torch.Size([32, 64, 20]), dtype) == one
        for b in (0, 1, 2 ** 21 - 1, 2 ** 21, 2 ** 21 + 1, 5 * 2 ** 21 + 32):
            assert deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(g, b) == align(b, 2 ** 21)
        with pytest.raises(moe_ep.InvalidArgument, match="num_max_session_bytes = -1"):
            deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(g, -1)
        with pytest.raises(moe_ep.InvalidArgument, match=r"shapes\[1\] = \(4, -2\) has a negative size -2"):
            deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(g, [(3,), (4, -2)], torch.float32)
        with pytest.raises(TypeError, match=r"shapes must be a shape .*\[\[3\], \[4\]\]"):  # DeepEP: a list of lists is one shape
            deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(g, [[3], [4]], torch.float32)
        return True
    assert moe_ep.LocalWorld(3).run(fn) == [True] * 3


def _buffer(g, session_bytes=4096, calls=2, configure=True):
    buf = deep_ep.ElasticBuffer(g, num_bytes=2 ** 21, explicitly_destroy=True, num_cpu_timeout_secs=TIMEOUT)
    if configure:
        buf.agrs_set_config(session_bytes, calls)
    return buf


def outcome(fn):
    """(error class name, message, ranks) of what fn raised; ("ok", "", []) when nothing."""
    try:
        fn()
        return "ok", "", []
    except moe_ep.Error as e:
        return type(e).__name__, str(e), list(getattr(e, "ranks", []) or [])


def expect_all(outcomes, kind, *fragments):
    for r, (name, message, _) in enumerate(outcomes):
        assert name == kind, f"rank {r}: {name}: {message}"
        assert f"[rank {r}]" in message, message
        for f in fragments:
            assert f in message, f"rank {r}: '{f}' missing in: {message}"


def expect_rejected_by(outcomes, bad, kind, *fragments):
    for r, (name, message, ranks) in enumerate(outcomes):
        if r == bad:
            assert name == kind and message.startswith(f"[rank {r}]"), f"rank {r}: {name}: {message}"
            for f in fragments:
                assert f in message, f"rank {r}: '{f}' missing in: {message}"
        else:
            assert name == "PeerError" and ranks == [bad], f"rank {r}: {name} {ranks}: {message}"


def test_enabled_false_is_a_no_op():
    def fn(g):
        buf = _buffer(g)
        with buf.agrs_new_session(enabled=False):  # no session of its own
            no_session = outcome(lambda: buf.all_gather(torch.ones(4)))
        buf.create_agrs_session()
        with buf.agrs_new_session(enabled=False):  # leaves the open session alone
            out, handle = buf.all_gather(torch.full((4,), float(g.rank())))
        handle()
        assert torch.equal(out, torch.arange(g.size(), dtype=torch.float32)[:, None].expand(g.size(), 4))
        buf.destroy_agrs_session()
        buf.destroy()
        return no_session
    outs = moe_ep.LocalWorld(2).run(fn)
    expect_all(outs, "StateError", "all_gather", "no session is open")


def test_calls_outside_a_configured_session():
    def fn(g):
        buf = _buffer(g, configure=False)
        buf.create_agrs_session()  # does not need the configuration
        unconfigured = [outcome(lambda: buf.all_gather(torch.ones(4))),
                        outcome(lambda: buf.agrs_get_inplace_tensor((4,), torch.float32))]
        buf.destroy_agrs_session()
        buf.agrs_set_config(4096, 2)
        outside = [outcome(lambda: buf.all_gather(torch.ones(4))),
                   outcome(lambda: buf.agrs_get_inplace_tensor((4,), torch.float32)),
                   outcome(buf.destroy_agrs_session)]
        buf.create_agrs_session()
        twice = outcome(buf.create_agrs_session)
        buf.destroy_agrs_session()
        buf.destroy()
        return unconfigured, outside, twice
    outs = moe_ep.LocalWorld(3).run(fn)
    for i in range(2):
        expect_all([o[0][i] for o in outs], "StateError", "agrs_set_config first")
    for i, op in enumerate(("all_gather", "agrs_get_inplace_tensor", "destroy_agrs_session")):
        expect_all([o[1][i] for o in outs], "StateError", op, "no session is open")
    expect_all([o[2] for o in outs], "StateError", "create_agrs_session: session 2 is already open")


def test_session_limits():
    def fn(g):
        R = g.size()
        buf = _buffer(g, session_bytes=3 * align(R * 64 * 4, 32), calls=2)
        x = torch.ones(64, dtype=torch.float32)
        with buf.agrs_new_session():
            buf.all_gather([x, x])  # two blocks in one call: one slot
            too_big = outcome(lambda: buf.all_gather([x, x]))  # a fourth block does not fit
            places = outcome(lambda: buf.agrs_get_inplace_tensor([(64,), (64,)], torch.float32))
            buf.all_gather(x)  # the failed call took nothing: the third block fits
            slots = outcome(lambda: buf.all_gather(torch.ones(0)))  # Q = 2 calls per session
            place_slots = outcome(lambda: buf.agrs_get_inplace_tensor((0,), torch.float32))
        with buf.agrs_new_session():  # a new session starts from offset 0, slot 0
            *out, handle = buf.all_gather([x, x, x])
            handle()
        buf.destroy()
        return too_big, places, slots, place_slots, out
    outs = moe_ep.LocalWorld(2).run(fn)
    block = align(2 * 64 * 4, 32)
    expect_all([o[0] for o in outs], "CapacityError", "all_gather", "Not enough session buffer size",
               f"t[1] needs session bytes [{3 * block}, {4 * block})", f"holds {3 * block}")
    expect_all([o[1] for o in outs], "CapacityError", "agrs_get_inplace_tensor", "Not enough session buffer size",
               f"shapes[1] needs session bytes [{3 * block}, {4 * block})")
    expect_all([o[2] for o in outs], "StateError", "all_gather", "Not enough session buffer size",
               "already made 2 all_gather calls")
    expect_all([o[3] for o in outs], "StateError", "agrs_get_inplace_tensor", "already made 2 all_gather calls")
    assert all(len(o[4]) == 3 for o in outs)


def test_in_place_at_the_wrong_offset():
    def fn(g):
        buf = _buffer(g)
        with buf.agrs_new_session():
            place = buf.agrs_get_inplace_tensor((8,), torch.float32)  # where the next call puts this rank's row
            place.fill_(1.0)
            buf.all_gather(torch.zeros(4))  # ... but this call comes first
            wrong = outcome(lambda: buf.all_gather(place if g.rank() == 1 else torch.ones(8)))
            out, handle = buf.all_gather(torch.full((8,), float(g.rank())))  # still usable, same session
            handle()
            ok = torch.equal(out, torch.arange(g.size(), dtype=torch.float32)[:, None].expand(g.size(), 8))
        buf.destroy()
        return wrong, ok
    outs = moe_ep.LocalWorld(3).run(fn)
    expect_rejected_by([o[0] for o in outs], 1, "InvalidArgument", "t lies in the session region at byte offset",
                       "in-place position")
    assert all(o[1] for o in outs)


def test_sizes_must_match_across_ranks():
    def fn(g):
        buf = _buffer(g, calls=4)
        r = g.rank()
        with buf.agrs_new_session():
            total = outcome(lambda: buf.all_gather(torch.ones(8 if r == 2 else 4)))
            swapped = outcome(lambda: buf.all_gather([torch.ones(8), torch.ones(4)] if r == 0
                                                     else [torch.ones(4), torch.ones(8)]))
            count = outcome(lambda: buf.all_gather([torch.ones(4)] * (2 if r == 1 else 1)))
            out, handle = buf.all_gather(torch.full((4,), float(r)))  # nothing moved: still usable
            handle()
            ok = torch.equal(out, torch.arange(g.size(), dtype=torch.float32)[:, None].expand(g.size(), 4))
        buf.destroy()
        return total, swapped, count, ok
    outs = moe_ep.LocalWorld(4).run(fn)
    for i, what in enumerate(("total input bytes", "the size of t[0]", "number of tensors")):
        for r, (name, message, _) in enumerate(o[i] for o in outs):
            assert name == "PeerError" and f"[rank {r}] all_gather" in message and what in message, message
    assert outs[0][1][2] == [1, 2, 3] and outs[1][1][2] == [0]  # each names the ranks that differ from it
    assert all(o[3] for o in outs)


def test_handle_outside_its_session():
    def fn(g):
        buf = _buffer(g)
        with buf.agrs_new_session():
            _, handle = buf.all_gather(torch.ones(4))
        after = outcome(handle)
        with buf.agrs_new_session():
            later = outcome(handle)
        buf.destroy()
        destroyed = outcome(handle)
        return after, later, destroyed
    outs = moe_ep.LocalWorld(2).run(fn)
    expect_all([o[0] for o in outs], "StateError", "handle: called outside its session 1 (no session is open)")
    expect_all([o[1] for o in outs], "StateError", "outside its session 1 (session 2 is open)")
    expect_all([o[2] for o in outs], "StateError", "all_gather handle: its buffer no longer exists")


def test_destroy_without_a_session_on_one_rank():
    def fn(g):
        buf = _buffer(g)
        if g.rank() != 2:
            buf.create_agrs_session()
        result = outcome(buf.destroy_agrs_session)
        with buf.agrs_new_session():  # every rank left its session: a new one works
            out, handle = buf.all_gather(torch.ones(2))
            handle()
        buf.destroy()
        return result
    expect_rejected_by(moe_ep.LocalWorld(3).run(fn), 2, "StateError", "destroy_agrs_session: no session is open")


@pytest.mark.parametrize("bytes_,calls,fragment", [
    (4096, 33, "num_max_all_gathers_per_session = 33 is outside [1, 32]"),
    (4096, 0, "num_max_all_gathers_per_session = 0 is outside [1, 32]"),
    (2 ** 21 + 1, 4, f"num_max_session_bytes = {2 ** 21 + 1} is outside [1, num_bytes = {2 ** 21}]"),
    (0, 4, "num_max_session_bytes = 0 is outside"),
])
def test_set_config_arguments(bytes_, calls, fragment):
    def fn(g):
        buf = _buffer(g, configure=False)
        result = outcome(lambda: buf.agrs_set_config(bytes_, calls))
        buf.destroy()
        return result
    expect_all(moe_ep.LocalWorld(2).run(fn), "InvalidArgument", "agrs_set_config", fragment)


def test_set_config_bad_value_on_one_rank_and_in_a_session():
    def fn(g):
        buf = _buffer(g, configure=False)
        one = outcome(lambda: buf.agrs_set_config(4096, 40 if g.rank() == 1 else 4))
        differ = outcome(lambda: buf.agrs_set_config(4096 + 32 * g.rank(), 4))
        buf.agrs_set_config(4096, 4)
        buf.create_agrs_session()
        in_session = outcome(lambda: buf.agrs_set_config(8192, 4))
        buf.destroy_agrs_session()
        buf.destroy()
        return one, differ, in_session
    outs = moe_ep.LocalWorld(3).run(fn)
    expect_rejected_by([o[0] for o in outs], 1, "InvalidArgument", "num_max_all_gathers_per_session = 40")
    for r, (name, message, _) in enumerate(o[1] for o in outs):
        assert name == "PeerError" and "ranks disagree on num_max_session_bytes" in message, message
    expect_all([o[2] for o in outs], "StateError", "session 1 is open")


def test_set_config_type_error_reaches_the_caller():
    def fn(g):
        buf = _buffer(g, configure=False)
        try:
            buf.agrs_set_config(4096 if g.rank() else 4096.0, 4)
            result = "ok"
        except TypeError as e:
            result = str(e)
        except moe_ep.PeerError as e:
            result = e.ranks
        buf.destroy()
        return result
    outs = moe_ep.LocalWorld(2).run(fn)
    assert "num_max_session_bytes must be an int, not float" in outs[0] and outs[1] == [0]


def test_groups_the_sessions_refuse():
    def one_rank(g):
        buf = _buffer(g, configure=False)
        return outcome(lambda: buf.agrs_set_config(4096, 4))
    expect_all(moe_ep.LocalWorld(1).run(one_rank), "InvalidArgument", "at least 2 ranks; this one has 1")

    def two_nodes(g):
        buf = deep_ep.ElasticBuffer(g, num_bytes=2 ** 21, num_cpu_timeout_secs=TIMEOUT)
        return outcome(lambda: buf.agrs_set_config(4096, 4))
    expect_all(moe_ep.LocalWorld(4, num_scaleout=2).run(two_nodes), "InvalidArgument",
               "one shared-memory domain (one node); the group spans 2 nodes of 2 ranks")


def test_views_outlive_their_region():
    """Results kept past a reconfiguration and past the buffer read the gathered bytes (the region
    stays mapped while a view of it exists); the next region is memory of its own."""
    def fn(g):
        R, r = g.size(), g.rank()
        buf = _buffer(g, calls=4)
        with buf.agrs_new_session():
            kept, _ = buf.all_gather(torch.full((16,), float(r)))
        buf.agrs_set_config(4096, 4)  # a new region; the old one stays while `kept` views it
        with buf.agrs_new_session():
            other, _ = buf.all_gather(torch.full((16,), float(-r)))
        buf.destroy()
        want = torch.arange(R, dtype=torch.float32)[:, None].expand(R, 16)
        return torch.equal(kept, want) and torch.equal(other, -want)
    assert moe_ep.LocalWorld(4).run(fn) == [True] * 4


def test_bad_inputs_reach_every_rank():
    def fn(g):
        buf = _buffer(g, calls=4)
        r = g.rank()
        with buf.agrs_new_session():
            strided = outcome(lambda: buf.all_gather(torch.ones(4, 4).t() if r == 0 else torch.ones(4, 4)))
            try:
                buf.all_gather([torch.ones(4), "x" if r == 1 else torch.ones(4)])
                not_a_tensor = "ok"
            except TypeError as e:
                not_a_tensor = str(e)
            except moe_ep.PeerError as e:
                not_a_tensor = e.ranks
            empty = outcome(lambda: buf.all_gather([]))
            out, handle = buf.all_gather(torch.full((2,), float(r)))  # nothing moved: still usable
            handle()
        buf.destroy()
        return strided, not_a_tensor, empty, out[:, 0].tolist()
    outs = moe_ep.LocalWorld(3).run(fn)
    expect_rejected_by([o[0] for o in outs], 0, "InvalidArgument", "all_gather", "t must be contiguous")
    assert "t[1]" in outs[1][1] and outs[0][1] == outs[2][1] == [1], [o[1] for o in outs]
    expect_all([o[2] for o in outs], "InvalidArgument", "needs at least one tensor (got 0)")
    assert all(o[3] == [0.0, 1.0, 2.0] for o in outs)
