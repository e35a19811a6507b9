"""Arguments the Python layer cannot convert (docs/python.md, "Errors"): tensors torch does not
export through DLPack (meta device, sparse layouts, nested and quantized tensors), integers out of
range or not integers, a non-tensor given to empty_like, and calls on a destroyed buffer. Each is the
documented class naming the argument; in a collective call the rank that passed it raises it and
its peers PeerError naming that rank, after which the buffer still works (ranks as threads)."""

import pytest
import torch

import moe_ep
from moe_ep import deep_ep
from moe_ep.deep_ep import hybrid_ep

from scenarios import v1_buffer
from test_dispatcher import check_round, make_dispatcher
from test_errors import E, H, K, T, check_v1_works, check_v2_works, inputs_of, v2_buffer

BIG = 2 ** 64  # fits no C++ integer
INT_LIMIT = "must be at most 2147483647"

# What torch will not export through DLPack, and the words naming it in the refusal.
UNEXPORTABLE = {
    "meta": (lambda t: t.to("meta"), "device meta"),
    "sparse_coo": (lambda t: t.to_sparse(), "layout torch.sparse_coo"),
    "sparse_csr": (lambda t: t.to_sparse_csr(), "layout torch.sparse_csr"),
    "nested": (lambda t: torch.nested.nested_tensor([t[0], t[1][:-1]]), "nested tensor"),
    "quantized": (lambda t: torch.quantize_per_tensor(t.float(), 0.5, 0, torch.qint8), "dtype torch.qint8"),
}


def outcome(fn):
    """("ok",) or (class name, message, ranks named by a PeerError)."""
    try:
        fn()
        return ("ok",)
    except moe_ep.PeerError as e:
        return ("PeerError", str(e), list(e.ranks))
    except Exception as e:  # the test compares each rank's class and message
        return (type(e).__name__, str(e), [])


def expect_refused(results, kind, *words, bad_rank=0, peers_see_words=True):
    """bad_rank raised `kind` with a message holding the words; every other rank PeerError naming
    bad_rank (and the words, when peers_see_words)."""
    for r, (name, *rest) in enumerate(results):
        message, ranks = rest if rest else ("", [])
        if r == bad_rank:
            assert name == kind, results
        else:
            assert name == "PeerError" and ranks == [bad_rank], results
            assert f"rank {bad_rank}" in message, message
        for w in words if r == bad_rank or peers_see_words else ():
            assert w in message, (r, w, message)


# ---- tensors torch does not export ----------------------------------------------------------


# torch quantizes float tensors only: no quantized topk_idx.
@pytest.mark.parametrize("arg,kind", [("x", k) for k in sorted(UNEXPORTABLE)] +
                         [("topk_idx", k) for k in sorted(UNEXPORTABLE) if k != "quantized"])
def test_v2_dispatch_refuses_unexportable_tensors(arg, kind):
    make, words = UNEXPORTABLE[kind]

    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        args = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E)
        if g.rank() == 0:
            args[arg] = make(args[arg])
        got = outcome(lambda: buf.dispatch(**args))
        check_v2_works(buf, g)
        buf.destroy()
        return got
    expect_refused(moe_ep.LocalWorld(2).run(fn), "TypeError", arg, words)


@pytest.mark.parametrize("kind", ["meta", "sparse_coo"])
def test_v2_combine_refuses_unexportable_tensors(kind):
    make, words = UNEXPORTABLE[kind]

    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        recv_x, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        got = outcome(lambda: buf.combine(make(recv_x) if g.rank() == 0 else recv_x, handle))
        check_v2_works(buf, g)
        buf.destroy()
        return got
    expect_refused(moe_ep.LocalWorld(2).run(fn), "TypeError", "x", words)


@pytest.mark.parametrize("kind", ["meta", "sparse_coo", "nested"])
def test_v1_calls_refuse_unexportable_tensors(kind):
    make, words = UNEXPORTABLE[kind]

    def fn(g):
        buf = v1_buffer(g, deep_ep, low_latency_mode=True)
        _, (x, idx, w) = inputs_of(g)
        bad = g.rank() == 0
        layout = outcome(lambda: buf.get_dispatch_layout(make(idx) if bad else idx, E))  # local: no peer
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        normal = outcome(lambda: buf.dispatch(make(x) if bad else x, num_tokens_per_rank=per_rank,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=idx, topk_weights=w))
        check_v1_works(buf, g)
        buf.clean_low_latency_buffer(16, H, E)
        low_latency = outcome(lambda: buf.low_latency_dispatch(make(x) if bad else x, idx, 16, E, use_fp8=False))
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 16, E, use_fp8=False)
        assert recv.shape == (E // g.size(), g.size() * 16, H)
        buf.destroy()
        return layout, normal, low_latency
    layout, normal, low_latency = zip(*moe_ep.LocalWorld(2).run(fn))
    assert layout[0][0] == "TypeError" and "topk_idx" in layout[0][1] and words in layout[0][1], layout
    assert layout[1] == ("ok",), layout
    expect_refused(normal, "TypeError", "x", words)
    expect_refused(low_latency, "TypeError", "x", words)


def test_dispatcher_refuses_unexportable_tensors():
    def fn(g):
        cache, d = make_dispatcher(g)
        _, (x, idx, w) = inputs_of(g)
        got = outcome(lambda: d.dispatch(x.to("meta") if g.rank() == 0 else x, idx, w))
        check_round(g, d, "prefill", 3, "normal")  # the group goes on
        cache.destroy()
        return got
    # The C++ dispatcher takes no rejection message: the peers learn that rank 0's tensors were
    # refused ("x is missing"), not why.
    expect_refused(moe_ep.LocalWorld(2).run(fn), "TypeError", "hidden_states", "device meta", peers_see_words=False)


def test_empty_like_takes_dense_torch_tensors():
    for bad, words in (([1, 2], "t must be a torch.Tensor, not list"), ("x", "not str"),
                       (torch.zeros(3, 4).to_sparse(), "layout torch.sparse_coo")):
        with pytest.raises(TypeError, match="^t ") as info:
            moe_ep.empty_like(bad)
        assert words in str(info.value), str(info.value)
    like = moe_ep.empty_like(torch.zeros(3, 4, dtype=torch.float16, device="meta"))  # shape and dtype only
    assert (like.shape, like.dtype, like.device.type) == ((3, 4), torch.float16, "cpu")


# ---- integers --------------------------------------------------------------------------------


def test_collective_integer_out_of_range_is_a_rejection():
    """num_experts = 2**64 on rank 0: InvalidArgument (a ValueError) naming the argument, the value
    and the limit there, PeerError naming rank 0 on rank 1; the buffer still works."""
    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        calls = [lambda e: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e),
                 lambda e: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=e),
                 lambda e: buf.pp_set_config(e, 2), lambda e: buf.agrs_set_config(e, 2)]
        bad = (BIG, -BIG, BIG, BIG)
        got = [outcome(lambda: call(b if g.rank() == 0 else E)) for call, b in zip(calls, bad)]
        got.append(outcome(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=16.0 if g.rank() == 0
                                                else E)))
        check_v2_works(buf, g)
        buf.destroy()
        return got
    results = list(zip(*moe_ep.LocalWorld(2).run(fn)))
    expect_refused(results[0], "InvalidArgument", f"num_experts = {BIG} is out of range ({INT_LIMIT})")
    expect_refused(results[1], "InvalidArgument",
                   f"expert_alignment = {-BIG} is out of range (must be at least -2147483648)")
    expect_refused(results[2], "InvalidArgument",
                   f"num_max_tensor_bytes = {BIG} is out of range (must be at most {2 ** 63 - 1})")
    expect_refused(results[3], "InvalidArgument", f"num_max_session_bytes = {BIG} is out of range")
    expect_refused(results[4], "TypeError", "num_experts must be an int, not float")
    assert issubclass(moe_ep.InvalidArgument, ValueError)


def test_constructor_integers_are_rejections():
    """A buffer's size that fits no integer on one rank refuses the construction on every rank."""
    def fn(g):
        bad = g.rank() == 1
        v2 = outcome(lambda: deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=BIG if bad else H,
                                                   num_topk=K))
        v1 = outcome(lambda: deep_ep.Buffer(g, (1 << 22) if not bad else 1.5, 0))
        ll = v1_buffer(g, deep_ep, low_latency_mode=True)
        clean = outcome(lambda: ll.clean_low_latency_buffer(16, -BIG if bad else H, E))
        ll.clean_low_latency_buffer(16, H, E)  # the group goes on
        ll.destroy()
        return v2, v1, clean
    v2, v1, clean = zip(*moe_ep.LocalWorld(2).run(fn))
    expect_refused(v2, "InvalidArgument", f"hidden = {BIG} is out of range ({INT_LIMIT})", bad_rank=1)
    expect_refused(v1, "TypeError", "num_nvl_bytes must be an int, not float", bad_rank=1)
    expect_refused(clean, "InvalidArgument", f"hidden = {-BIG} is out of range (must be at least -2147483648)",
                   bad_rank=1)


def local_calls(g):
    """Calls that involve no other rank, each with one integer argument that fits no C++ int:
    (the argument's name, the call)."""
    v2 = v2_buffer(g)
    v1 = v1_buffer(g, deep_ep, low_latency_mode=True)
    cache = moe_ep.BufferCache(g)
    d = moe_ep.TokenDispatcher(cache, H, E, K)
    idx = inputs_of(g)[1][1]
    Buffer, Elastic = deep_ep.Buffer, deep_ep.ElasticBuffer
    calls = [
        ("num_max_tokens_per_rank", lambda: Elastic.get_buffer_size_hint(g, BIG, H)),
        ("num_experts", lambda: v2.get_theoretical_num_sms(BIG, K)),
        ("num_sms", lambda: v2.get_theoretical_num_qps(BIG)),
        ("num_entries", lambda: Elastic.get_engram_storage_size_hint(BIG, H, T)),
        ("num_qps", lambda: v2.engram_fetch(torch.zeros(1, 1, dtype=torch.int32), num_qps=BIG)),
        ("num_max_inflight_tensors", lambda: Elastic.get_pp_buffer_size_hint(1024, BIG)),
        ("dst_rank_idx", lambda: v2.pp_send(torch.zeros(8), BIG)),
        ("src_rank_idx", lambda: v2.pp_recv(torch.zeros(8), BIG)),
        ("num_max_session_bytes", lambda: Elastic.get_agrs_buffer_size_hint(g, BIG)),
        ("shapes[1]", lambda: Elastic.get_agrs_num_max_session_bytes(g, (4, BIG), torch.bfloat16)),
        ("num_sms", lambda: deep_ep.Config(num_sms=BIG)),
        ("hidden_bytes", lambda: deep_ep.Config().get_nvl_buffer_size_hint(BIG, 2)),
        ("new_num_sms", lambda: Buffer.set_num_sms(BIG)),
        ("num_ranks", lambda: Buffer.get_dispatch_config(BIG)),
        ("num_experts", lambda: Buffer.get_low_latency_rdma_size_hint(16, H, 2, BIG)),
        ("num_experts", lambda: v1.get_dispatch_layout(idx, BIG)),
        ("rank_to_mask", lambda: v1.low_latency_update_mask_buffer(BIG)),
        ("offset", lambda: v1.get_local_buffer_tensor(torch.uint8, offset=BIG)),
        ("hidden", lambda: moe_ep.TokenDispatcher(cache, BIG, E, K)),
        ("num_max_dispatch_tokens_per_rank", lambda: moe_ep.TokenDispatcher(cache, H, E, K,
                                                                            num_max_dispatch_tokens_per_rank=BIG)),
        ("micro_batch", lambda: d.dispatch_b(BIG)),
        ("size[1]", lambda: moe_ep.empty(2, BIG)),
        ("num_ranks", lambda: moe_ep.LocalWorld(BIG)),
    ]
    return calls, lambda: (v2.destroy(), v1.destroy(), cache.destroy())


def test_local_integer_out_of_range():
    def fn(g):
        calls, done = local_calls(g)
        for name, call in calls:
            with pytest.raises(moe_ep.InvalidArgument) as info:
                call()
            assert f"{name} = {BIG} is out of range (must be at most " in str(info.value), (name, str(info.value))
        done()
        return len(calls)
    assert moe_ep.LocalWorld(1).run(fn) == [23]


def test_local_integer_limits_and_types():
    with pytest.raises(moe_ep.InvalidArgument, match=r"size\[0\] = -1 is out of range \(must be at least 0\)"):
        moe_ep.empty(-1, 4)
    with pytest.raises(TypeError, match=r"size\[0\] must be an int, not float"):
        moe_ep.empty(1.5)
    with pytest.raises(moe_ep.InvalidArgument, match=r"num_ranks = 0 is out of range \(must be at least 1\)"):
        moe_ep.LocalWorld(0)
    with pytest.raises(TypeError, match="num_ranks must be an int, not str"):
        moe_ep.LocalWorld("2")
    with pytest.raises(TypeError, match="num_max_dispatch_tokens_per_rank must be an int, not bool"):
        deep_ep.Buffer.get_low_latency_rdma_size_hint(True, H, 2, E)

    def fn(g):
        buf = v2_buffer(g)
        # num_sms of dispatch is at most kMaxWorkers; so is the num_sms the QP model is asked about.
        with pytest.raises(moe_ep.InvalidArgument, match=r"num_sms = -1 is out of range \(must be at least 0\)"):
            buf.get_theoretical_num_qps(-1)
        with pytest.raises(moe_ep.InvalidArgument, match=r"num_sms = 1025 is out of range \(must be at most 1024\)"):
            buf.get_theoretical_num_qps(1025)
        same = buf.get_theoretical_num_qps(torch.tensor(2)) == buf.get_theoretical_num_qps(2)  # 0-d integer tensors
        buf.destroy()
        return same
    assert moe_ep.LocalWorld(1).run(fn) == [True]


# ---- calls on a destroyed buffer -------------------------------------------------------------


def public_methods(cls):
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)) and n not in ("group",)}


def v1_after_destroy(x, idx, w, layout, handle, ll_handle):
    per_rank, per_expert, in_rank = layout
    return {
        "destroy": lambda b: b.destroy(),
        "get_dispatch_layout": lambda b: b.get_dispatch_layout(idx, E),
        "dispatch": lambda b: b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w),
        "combine": lambda b: b.combine(x, handle),
        "clean_low_latency_buffer": lambda b: b.clean_low_latency_buffer(16, H, E),
        "low_latency_dispatch": lambda b: b.low_latency_dispatch(x, idx, 16, E, use_fp8=False),
        "low_latency_combine": lambda b: b.low_latency_combine(x, idx, w, ll_handle),
        "get_next_low_latency_combine_buffer": lambda b: b.get_next_low_latency_combine_buffer(ll_handle),
        "low_latency_update_mask_buffer": lambda b: b.low_latency_update_mask_buffer(1, True),
        "low_latency_query_mask_buffer": lambda b: b.low_latency_query_mask_buffer(torch.zeros(2, dtype=torch.int32)),
        "low_latency_clean_mask_buffer": lambda b: b.low_latency_clean_mask_buffer(),
        "get_local_buffer_tensor": lambda b: b.get_local_buffer_tensor(torch.uint8),
    }


# Methods that do not use the buffer's state (static, or answers fixed at construction): they still work.
V1_STATELESS = {"capture", "get_comm_stream", "get_combine_config", "get_dispatch_config",
                "get_low_latency_rdma_size_hint", "is_sm90_compiled", "set_num_sms"}


@pytest.mark.parametrize("cls", [deep_ep.Buffer, hybrid_ep.Buffer], ids=["v1", "hybrid_ep_v1"])
def test_v1_calls_after_destroy_are_state_errors(cls):
    def fn(g):
        buf = cls(g, 1 << 22, 1 << 24, low_latency_mode=True, explicitly_destroy=True, enable_shrink=True)
        _, (x, idx, w) = inputs_of(g)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        buf.clean_low_latency_buffer(16, H, E)
        _, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, 16, E, use_fp8=False)
        buf.destroy()
        calls = v1_after_destroy(x, idx, w, (per_rank, per_expert, in_rank), handle, ll_handle)
        assert public_methods(cls) == set(calls) | V1_STATELESS, public_methods(cls) ^ (set(calls) | V1_STATELESS)
        for name, call in calls.items():
            with pytest.raises(moe_ep.StateError, match=rf"\[rank {g.rank()}\] the buffer was destroyed"):
                call(buf)
        assert buf.get_dispatch_config(2).num_sms > 0 and not buf.is_sm90_compiled()
        return len(calls)
    assert moe_ep.LocalWorld(2).run(fn) == [12, 12]


V2_STATELESS = {"capture", "get_comm_stream", "get_buffer_size_hint", "get_engram_storage_size_hint",
                "get_pp_buffer_size_hint", "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint"}


def test_v2_calls_after_destroy_are_state_errors():
    def fn(g):
        buf = v2_buffer(g)
        _, (x, idx, w) = inputs_of(g)
        _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        buf.destroy()
        t = torch.zeros(8)
        calls = {
            "destroy": lambda: buf.destroy(),
            "dispatch": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E),
            "combine": lambda: buf.combine(x, handle),
            "barrier": lambda: buf.barrier(),
            "get_physical_domain_size": lambda: buf.get_physical_domain_size(),
            "get_logical_domain_size": lambda: buf.get_logical_domain_size(),
            "get_theoretical_num_sms": lambda: buf.get_theoretical_num_sms(E, K),
            "get_theoretical_num_qps": lambda: buf.get_theoretical_num_qps(2),
            "engram_write": lambda: buf.engram_write(torch.zeros(4, H, dtype=torch.bfloat16)),
            "engram_fetch": lambda: buf.engram_fetch(torch.zeros(1, 1, dtype=torch.int32)),
            "pp_set_config": lambda: buf.pp_set_config(1024, 2),
            "pp_send": lambda: buf.pp_send(t, 1),
            "pp_recv": lambda: buf.pp_recv(t, 1),
            "agrs_set_config": lambda: buf.agrs_set_config(1 << 20, 2),
            "create_agrs_session": lambda: buf.create_agrs_session(),
            "destroy_agrs_session": lambda: buf.destroy_agrs_session(),
            "agrs_new_session": lambda: buf.agrs_new_session().__enter__(),
            "agrs_get_inplace_tensor": lambda: buf.agrs_get_inplace_tensor((4, 4), torch.float32),
            "all_gather": lambda: buf.all_gather(t),
        }
        names = public_methods(deep_ep.ElasticBuffer)
        assert names == set(calls) | V2_STATELESS, names ^ (set(calls) | V2_STATELESS)
        for name, call in calls.items():
            with pytest.raises(moe_ep.StateError, match=rf"\[rank {g.rank()}\] the buffer was destroyed"):
                call()
        return len(calls)
    assert moe_ep.LocalWorld(2).run(fn) == [19, 19]
