"""DeepEP's data path through moe_ep.deep_ep on LocalWorld threads (2 and 4 ranks on one node,
and 4 ranks on 2 logical nodes), every output checked against tests/python/reference.py."""

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

import scenarios

TOPOLOGIES = [pytest.param(2, 1, id="2x1"), pytest.param(4, 1, id="4x1"), pytest.param(4, 2, id="2x2")]


def run(n, so, fn):
    return moe_ep.LocalWorld(n, so).run(fn)


@pytest.mark.parametrize("n,so", TOPOLOGIES)
@pytest.mark.parametrize("do_cpu_sync", [True, False, None], ids=["cpu_sync", "no_cpu_sync", "default_sync"])
def test_v2_compact_dispatch_combine(n, so, do_cpu_sync):
    out = run(n, so, lambda g: scenarios.v2_compact(g, deep_ep, do_cpu_sync=do_cpu_sync))
    assert [o["rank"] for o in out] == list(range(n))


@pytest.mark.parametrize("n,so", TOPOLOGIES)
def test_v2_compact_without_weights_and_bias(n, so):
    run(n, so, lambda g: scenarios.v2_compact(g, deep_ep, weights=False, bias=False, seed=4))


@pytest.mark.parametrize("n,so", [pytest.param(4, 2, id="2x2")])
def test_v2_direct_path_across_nodes(n, so):
    # allow_hybrid_mode=False: logical 1 x R, no per-node reduction
    run(n, so, lambda g: scenarios.v2_compact(g, deep_ep, allow_hybrid_mode=False, seed=6))


@pytest.mark.parametrize("n,so", TOPOLOGIES)
def test_v2_fp8_pass_through(n, so):
    run(n, so, lambda g: scenarios.v2_compact(g, deep_ep, fp8=True, seed=7))


@pytest.mark.parametrize("n,so", TOPOLOGIES)
def test_v2_async_with_compute_stream(n, so):
    run(n, so, lambda g: scenarios.v2_compact(g, deep_ep, async_=True, seed=8))


@pytest.mark.parametrize("n,so", TOPOLOGIES)
@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("multi", [True, False], ids=["multi_reduction", "single_reduction"])
def test_v2_expanded(n, so, alignment, multi):
    run(n, so, lambda g: scenarios.v2_expanded(g, deep_ep, alignment=alignment, allow_multiple_reduction=multi))


@pytest.mark.parametrize("n,so", [pytest.param(2, 1, id="2x1"), pytest.param(4, 2, id="2x2")])
def test_v2_expanded_without_cpu_sync(n, so):
    run(n, so, lambda g: scenarios.v2_expanded(g, deep_ep, alignment=8, do_cpu_sync=False, weights=False, seed=9))


@pytest.mark.parametrize("n,so", TOPOLOGIES)
def test_v1_normal(n, so):
    run(n, so, lambda g: scenarios.v1_normal(g, deep_ep))


@pytest.mark.parametrize("n,so", TOPOLOGIES)
def test_v1_normal_aligned_fp8(n, so):
    run(n, so, lambda g: scenarios.v1_normal(g, deep_ep, fp8=True, alignment=8, seed=12))


@pytest.mark.parametrize("n,so", [pytest.param(2, 1, id="2x1"), pytest.param(4, 1, id="4x1")])
def test_v1_normal_num_worst_tokens(n, so):
    # DeepEP: num_worst_tokens is intranode only
    run(n, so, lambda g: scenarios.v1_normal(g, deep_ep, num_worst_tokens=12 * n, seed=13))


@pytest.mark.parametrize("n,so", TOPOLOGIES)
def test_v1_normal_async(n, so):
    run(n, so, lambda g: scenarios.v1_normal(g, deep_ep, async_=True, bias=False, seed=14))


LL_CASES = [
    pytest.param(dict(), id="bf16"),
    pytest.param(dict(return_recv_hook=True, combine_hook=True), id="bf16_hooks"),
    pytest.param(dict(async_finish=True), id="bf16_async"),
    pytest.param(dict(zero_copy=True, use_out=True), id="bf16_zero_copy_out"),
    pytest.param(dict(zero_copy=True, zero_copy_x="shape"), id="bf16_zero_copy_x_is_only_the_shape"),
    pytest.param(dict(zero_copy=True, zero_copy_x="shape", return_recv_hook=True, combine_hook=True),
                 id="bf16_zero_copy_x_is_only_the_shape_hooks"),
    pytest.param(dict(fp8=True, hidden=512), id="fp8"),
    pytest.param(dict(fp8=True, round_scale=True, hidden=512, return_recv_hook=True), id="fp8_round_scale"),
    pytest.param(dict(fp8=True, round_scale=True, use_ue8m0=True, hidden=512), id="fp8_ue8m0"),
]


@pytest.mark.parametrize("n,so", TOPOLOGIES)
@pytest.mark.parametrize("case", LL_CASES)
def test_v1_low_latency(n, so, case):
    run(n, so, lambda g: scenarios.v1_low_latency(g, deep_ep, **case))


@pytest.mark.parametrize("n,so", [pytest.param(2, 1, id="2x1"), pytest.param(4, 2, id="2x2")])
def test_v1_low_latency_several_rounds(n, so):
    # both slots used several times, alternating with combines
    run(n, so, lambda g: scenarios.v1_low_latency(g, deep_ep, rounds=3, return_recv_hook=True, seed=30))


@pytest.mark.parametrize("n,so", [pytest.param(4, 1, id="4x1"), pytest.param(4, 2, id="2x2")])
def test_v1_low_latency_documented_order(n, so):
    assert run(n, so, lambda g: scenarios.ll_order_is_source_then_token(g, deep_ep)) == [True] * n


@pytest.mark.parametrize("n,so", [pytest.param(2, 1, id="2x1"), pytest.param(4, 2, id="2x2")])
def test_normal_then_low_latency_on_one_buffer(n, so):
    """SGLang's auto mode: one low-latency-mode buffer serves normal batches too, with
    clean_low_latency_buffer on every normal -> low-latency switch."""
    def fn(g):
        buf = scenarios.v1_buffer(g, deep_ep, low_latency_mode=True)
        scenarios.v1_normal(g, deep_ep, buf=buf, seed=40)
        buf.clean_low_latency_buffer(16, 256, 16)
        scenarios.v1_low_latency(g, deep_ep, buf=buf, seed=41)
        scenarios.v1_normal(g, deep_ep, buf=buf, seed=42, cached=False)
        buf.clean_low_latency_buffer(16, 256, 16)
        scenarios.v1_low_latency(g, deep_ep, buf=buf, seed=43, return_recv_hook=True)
        buf.destroy()
    run(n, so, fn)


@pytest.mark.parametrize("n,so", [pytest.param(2, 1, id="2x1"), pytest.param(4, 2, id="2x2")])
def test_under_inference_mode(n, so):
    def fn(g):
        with torch.inference_mode():
            scenarios.v2_compact(g, deep_ep, seed=50)
            scenarios.v2_expanded(g, deep_ep, seed=51)
            scenarios.v1_normal(g, deep_ep, seed=52)
            scenarios.v1_low_latency(g, deep_ep, seed=53, return_recv_hook=True)
            return torch.is_inference_mode_enabled()
    assert run(n, so, fn) == [True] * n


def test_rank_without_tokens():
    """A rank with N = 0 takes part and gets [0, H] back (V2 and V1)."""
    def fn(g):
        # base_tokens=1 with 2 ranks: rank 1 has 0 tokens
        scenarios.v2_compact(g, deep_ep, base_tokens=1, seed=60, cached=False)
        scenarios.v1_normal(g, deep_ep, base_tokens=1, seed=61, cached=False)
        return True
    assert run(2, 1, fn) == [True, True]
