"""The core data-path checks over processes: spawned processes join a gloo process group, which
bootstraps moe-ep's host transport (shared memory on one host); `deep_ep` is imported through the
alias directory (build/deep_ep_alias on the children's PYTHONPATH). 2 and 4 processes on one
node, and 4 processes with MOE_EP_RANKS_PER_NODE=2 (the logical 2 x 2 topology)."""

import pytest

from conftest import check_all_ok, run_processes

TOPOLOGIES = [pytest.param(2, {}, (1, 2), id="2x1"), pytest.param(4, {}, (1, 4), id="4x1"),
              pytest.param(4, {"MOE_EP_RANKS_PER_NODE": "2"}, (2, 2), id="2x2")]


def _import_deep_ep():
    import deep_ep
    import deep_ep.utils
    import moe_ep.deep_ep
    assert deep_ep is moe_ep.deep_ep, f"import deep_ep gave {deep_ep!r}"
    assert deep_ep.utils.EventOverlap is moe_ep.deep_ep.utils.EventOverlap
    return deep_ep


def _core(rank, world, group, expect_domain):
    import scenarios
    deep_ep = _import_deep_ep()
    assert deep_ep.get_physical_domain_size(group) == expect_domain
    summary = {}
    summary["v2"] = scenarios.v2_compact(group, deep_ep, seed=100)
    summary["v2_nosync"] = scenarios.v2_compact(group, deep_ep, do_cpu_sync=False, seed=101)
    summary["v2_fp8"] = scenarios.v2_compact(group, deep_ep, fp8=True, seed=102)
    summary["v2_exp"] = scenarios.v2_expanded(group, deep_ep, alignment=4, seed=103)
    summary["v1"] = scenarios.v1_normal(group, deep_ep, seed=104)
    summary["v1_fp8"] = scenarios.v1_normal(group, deep_ep, fp8=True, alignment=4, seed=105)
    summary["ll"] = scenarios.v1_low_latency(group, deep_ep, return_recv_hook=True, combine_hook=True, seed=106)
    summary["ll_fp8"] = scenarios.v1_low_latency(group, deep_ep, fp8=True, hidden=512, seed=107)
    summary["ll_zero_copy"] = scenarios.v1_low_latency(group, deep_ep, zero_copy=True, async_finish=True, seed=108)
    return {k: v["rank"] for k, v in summary.items()}


@pytest.mark.parametrize("n,env,domain", TOPOLOGIES)
def test_core_paths_over_processes(n, env, domain):
    results = check_all_ok(run_processes(_core, n, args=(domain,), env=env))
    assert [r["v2"] for r in results] == list(range(n))


def _new_group(rank, world, group):
    """A second process group (dist.new_group) is a group of its own for moe-ep."""
    import torch.distributed as dist

    import scenarios
    deep_ep = _import_deep_ep()
    sub = dist.new_group(list(range(world)))
    scenarios.v2_compact(sub, deep_ep, seed=110, cached=False)
    scenarios.v1_normal(sub, deep_ep, seed=111, cached=False)
    return True


def test_new_group():
    assert check_all_ok(run_processes(_new_group, 2)) == [True, True]


def _v2_2x2_flags(rank, world, group):
    import scenarios
    deep_ep = _import_deep_ep()
    scenarios.v2_compact(group, deep_ep, allow_hybrid_mode=False, seed=120)
    scenarios.v2_expanded(group, deep_ep, allow_multiple_reduction=False, seed=121)
    scenarios.v1_low_latency(group, deep_ep, rounds=2, fp8=True, round_scale=True, use_ue8m0=True, hidden=512,
                             seed=122)
    return True


def test_hybrid_variants_over_processes():
    assert check_all_ok(run_processes(_v2_2x2_flags, 4, env={"MOE_EP_RANKS_PER_NODE": "2"})) == [True] * 4
