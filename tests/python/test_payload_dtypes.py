"""Payload dtypes and NVFP4 token triples through moe_ep.deep_ep on LocalWorld threads
(docs/semantics.md, "Payload dtypes"; docs/quantized-formats.md, "NVFP4 normal dispatch").

Payloads are random bits (NaN patterns included) and are compared bit for bit, as integer views,
with the rows tests/python/reference.py says each rank receives."""

import types

import pytest
import torch

import moe_ep
from moe_ep import deep_ep
from moe_ep.deep_ep import hybrid_ep

import reference as ref
from scenarios import assert_same, group_info, v1_buffer

E, K, T, N = 16, 4, 16, 12
TOPOLOGIES = [pytest.param(2, 1, id="2x1"), pytest.param(4, 1, id="4x1"), pytest.param(4, 2, id="2x2")]
# (dtype, hidden): rows of a multiple of 16 bytes
PAYLOADS = [pytest.param(torch.float16, 40, id="float16"), pytest.param(torch.float32, 20, id="float32"),
            pytest.param(torch.int8, 48, id="int8"), pytest.param(torch.int16, 24, id="int16"),
            pytest.param(torch.int32, 12, id="int32"), pytest.param(torch.uint8, 32, id="uint8"),
            pytest.param(torch.bfloat16, 8, id="bfloat16")]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t):
    return t.view(_BITS[t.element_size()])


def assert_bits(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert_same(bits(actual.contiguous()), bits(expected.contiguous()), what)


def random_payload(rank, n, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n, hidden * size), generator=gen, dtype=torch.int64).to(torch.uint8)
    return raw.view(dtype)


def run(n, so, fn):
    return moe_ep.LocalWorld(n, so).run(fn)


@pytest.mark.parametrize("n,so", TOPOLOGIES)
@pytest.mark.parametrize("dtype,hidden", PAYLOADS)
def test_v2_payload_dtypes(n, so, dtype, hidden):
    def fn(g):
        rank, R, _, _ = group_info(g)
        inputs = ref.make_inputs(R, N, hidden, E, K, seed=21)
        _, idx, w = inputs[rank]
        pay = [random_payload(s, inputs[s][0].shape[0], hidden, dtype, 1) for s in range(R)]
        buf = deep_ep.ElasticBuffer(g, num_bytes=32 << 20, num_max_tokens_per_rank=T, hidden=hidden, num_topk=K,
                                    explicitly_destroy=True)
        recv_x, recv_idx, _, handle, _ = buf.dispatch(pay[rank], topk_idx=idx, topk_weights=w, num_experts=E)
        exp = ref.v2_dispatch_compact(inputs, rank, E, payload=lambda s: pay[s])
        assert_bits(recv_x, exp["recv_x"], "recv_x")
        assert_same(recv_idx, exp["recv_topk_idx"], "recv_topk_idx")
        # cached: new payload of the same dtype, same routing
        pay2 = [random_payload(s, inputs[s][0].shape[0], hidden, dtype, 2) for s in range(R)]
        again, _, _, same, _ = buf.dispatch(pay2[rank], handle=handle, topk_weights=w)
        assert same is handle
        assert_bits(again, ref.v2_dispatch_compact(inputs, rank, E, payload=lambda s: pay2[s])["recv_x"],
                    "cached recv_x")
        # expanded layout: one row per (token, local expert), grouped by expert
        exp_x, _, exp_w, _, _ = buf.dispatch(pay[rank], topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True,
                                             expert_alignment=4)
        ex = ref.v2_dispatch_expanded(inputs, rank, E, 4)
        assert exp_x.shape == (ex["total"], hidden) and exp_x.dtype == dtype
        for i, rows in enumerate(ex["per_expert"]):
            if rows:
                got = exp_x[ex["starts"][i]:ex["starts"][i] + len(rows)]
                assert_bits(got, torch.stack([pay[s][t] for s, t, _ in rows]), f"expanded rows of expert {i}")
        # combine takes bfloat16 only
        if dtype != torch.bfloat16:
            with pytest.raises(moe_ep.InvalidArgument, match="combine reduces bfloat16 rows only"):
                buf.combine(recv_x, handle)
        combined, _, _ = buf.combine(torch.zeros(recv_x.shape[0], hidden, dtype=torch.bfloat16), handle)
        assert combined.shape == (idx.shape[0], hidden) and bool((combined == 0).all())
        buf.destroy()
    run(n, so, fn)


@pytest.mark.parametrize("n,so", TOPOLOGIES)
@pytest.mark.parametrize("dtype,hidden", PAYLOADS[:4])
def test_v1_payload_dtypes(n, so, dtype, hidden):
    def fn(g):
        rank, R, SU, SO = group_info(g)
        inputs = ref.make_inputs(R, N, hidden, E, K, seed=23)
        _, idx, w = inputs[rank]
        pay = [random_payload(s, inputs[s][0].shape[0], hidden, dtype, 3) for s in range(R)]
        buf = v1_buffer(g, deep_ep, hidden=hidden * 2, num_experts=E)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            pay[rank], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        exp = ref.v1_dispatch(inputs, rank, E, payload=lambda s: pay[s])
        assert_bits(recv_x, exp["recv_x"], "V1 recv_x")
        assert_same(recv_w, exp["recv_topk_weights"], "V1 recv_topk_weights")
        pay2 = [random_payload(s, inputs[s][0].shape[0], hidden, dtype, 4) for s in range(R)]
        out = buf.dispatch(pay2[rank], handle=handle)
        assert_bits(out[0], ref.v1_dispatch(inputs, rank, E, payload=lambda s: pay2[s])["recv_x"], "V1 cached recv_x")
        with pytest.raises(moe_ep.InvalidArgument, match="x has dtype"):
            buf.combine(recv_x, handle)
    run(n, so, fn)


def test_row_rule_is_named():
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, 12, E, K, seed=5)
        _, idx, _ = inputs[g.rank()]
        buf = deep_ep.ElasticBuffer(g, num_bytes=2 << 20, num_max_tokens_per_rank=T, num_topk=K)
        x = torch.zeros(idx.shape[0], 12, dtype=torch.float16)
        with pytest.raises(moe_ep.InvalidArgument, match=r"x is float16 \[\d+, 12\]: a row is 24 bytes, which must "
                                                         r"be a multiple of 16"):
            buf.dispatch(x, topk_idx=idx, num_experts=E)
        with pytest.raises(moe_ep.InvalidArgument, match="x has dtype int64"):
            buf.dispatch(torch.zeros(idx.shape[0], 16, dtype=torch.int64), topk_idx=idx, num_experts=E)
    run(2, 1, fn)


# ---- NVFP4 token triples (V1 normal dispatch) --------------------------------------------------

def random_triple(rank, n, hidden, scale_cols, seed):
    gen = torch.Generator().manual_seed(seed * 7919 + rank)

    def int32(cols):
        return torch.randint(-2 ** 31, 2 ** 31 - 1, (n, cols), generator=gen, dtype=torch.int64).to(torch.int32)
    return int32(hidden // 8), int32(hidden // 64), int32(scale_cols).view(torch.float32)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("buffer_module", [hybrid_ep, deep_ep], ids=["hybrid_ep", "deep_ep"])
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_v1_nvfp4_triple_round_trip(n, buffer_module, async_):
    hidden, S = 256, 3

    def fn(g):
        rank, R, _, _ = group_info(g)
        inputs = ref.make_inputs(R, N, hidden, E, K, seed=31)
        x, idx, w = inputs[rank]
        triples = [random_triple(s, inputs[s][0].shape[0], hidden, S, 1) for s in range(R)]
        buf = v1_buffer(g, types.SimpleNamespace(Buffer=buffer_module.Buffer), hidden=hidden, num_experts=E)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True) if async_ else {}
        recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
            triples[rank], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, **kw)
        if async_:
            ev.current_stream_wait()
        assert isinstance(recv_x, tuple) and len(recv_x) == 3, "the NVFP4 triple comes back as a triple"
        for part in range(3):
            exp = ref.v1_dispatch(inputs, rank, E, payload=lambda s: triples[s][part])
            assert recv_x[part].is_contiguous()
            assert_bits(recv_x[part], exp["recv_x"], f"recv_x[{part}]")
        exp = ref.v1_dispatch(inputs, rank, E)
        assert_same(recv_idx, exp["recv_topk_idx"], "recv_topk_idx")
        assert list(counts) == exp["num_recv_tokens_per_expert_list"]
        # cached dispatch of new triples
        triples2 = [random_triple(s, inputs[s][0].shape[0], hidden, S, 2) for s in range(R)]
        out = buf.dispatch(triples2[rank], handle=handle, **kw)
        if async_:
            out[-1].current_stream_wait()
        assert out[1:5] == (None, None, None, None)
        for part in range(3):
            exp2 = ref.v1_dispatch(inputs, rank, E, payload=lambda s: triples2[s][part])
            assert_bits(out[0][part], exp2["recv_x"], f"cached recv_x[{part}]")
        # the handle's hidden is H: a bfloat16 combine of [M, H] sums as usual
        M = len(exp["rows"])
        y = torch.zeros(M, hidden, dtype=torch.bfloat16)
        if M:
            y[:] = ref.rank_transform(exp["recv_x"], rank)
        combined, _, _ = buf.combine(y, handle)
        assert_same(combined, ref.combine_rank(inputs, rank, E, rank_rows_of=lambda d, t: ref.rank_transform(x[t], d)),
                    "combined_x")
    run(n, 1, fn)


def test_v1_nvfp4_refused_across_nodes():
    def fn(g):
        rank, R, _, _ = group_info(g)
        inputs = ref.make_inputs(R, N, 128, E, K, seed=33)
        _, idx, w = inputs[rank]
        buf = v1_buffer(g, types.SimpleNamespace(Buffer=hybrid_ep.Buffer), hidden=128, num_experts=E)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        with pytest.raises(moe_ep.InvalidArgument, match="intranode only.*spans 2 nodes"):
            buf.dispatch(random_triple(rank, idx.shape[0], 128, 1, 3), num_tokens_per_rank=per_rank,
                         num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=w)
    run(4, 2, fn)


BAD_TRIPLES = {
    "packed_float32": (lambda p, sf, sc: (p.float(), sf, sc), r"x\[0\] \(packed\) has dtype float32, expected int32"),
    "sf_columns": (lambda p, sf, sc: (p, sf[:, :1].contiguous(), sc), r"x\[1\] \(sf\) has 1 columns, expected H/64 = 2"),
    "tokens_differ": (lambda p, sf, sc: (p, sf, sc[:-1].contiguous()),
                      r"x\[2\] \(sf_scale\) has \d+ tokens but x\[0\] \(packed\) has \d+"),
    "packed_columns": (lambda p, sf, sc: (p[:, :12].contiguous(), sf, sc), r"x\[0\] \(packed\) has 12 columns"),
}


@pytest.mark.parametrize("case", list(BAD_TRIPLES))
def test_v1_nvfp4_bad_triples(case):
    edit, match = BAD_TRIPLES[case]

    def fn(g):
        rank, R, _, _ = group_info(g)
        inputs = ref.make_inputs(R, N, 128, E, K, seed=35)
        _, idx, w = inputs[rank]
        buf = v1_buffer(g, types.SimpleNamespace(Buffer=hybrid_ep.Buffer), hidden=128, num_experts=E)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        with pytest.raises(moe_ep.InvalidArgument, match=match):
            buf.dispatch(edit(*random_triple(rank, idx.shape[0], 128, 2, 4)), num_tokens_per_rank=per_rank,
                         num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=w)
    run(2, 1, fn)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.int16])
def test_moe_ep_empty_new_dtypes(dtype):
    t = moe_ep.empty(3, 16, dtype=dtype)
    assert t.dtype == dtype and t.shape == (3, 16)
