# Long file: vLLM's three all2all managers with their prepare/finalize classes and its modular kernel,
# each built as vLLM builds it, with the stand-ins of its CUDA kernels and one dense reference.
"""vLLM's own DeepEP code on moe-ep, unmodified, on 2 and 4 CPU processes over gloo, with
``deep_ep`` resolving to moe-ep through the alias directory (build tree) or the wheel's switch (installed), and moe_ep.deep_ep.cpu_compat
installed (vLLM allocates with device="cuda" and asks torch.accelerator for its stream):

- vLLM's parallel state (init_distributed_environment, initialize_model_parallel) under a
  VllmConfig with data_parallel_size = the world and expert parallelism, as a DeepEP deployment
  has it; its EP group's CPU group is what vLLM's CUDA communicator hands its all2all managers;
- the all2all managers of vllm/distributed/device_communicators/all2all.py, constructed as the CUDA
  communicator constructs them (DeepEPHTAll2AllManager(cpu_group, None),
  DeepEPLLAll2AllManager(cpu_group, None), DeepEPV2All2AllManager(cpu_group, None,
  device_group=...)), their buffers from get_handle with the arguments vLLM's
  maybe_make_prepare_finalize passes, and the prepare/finalize classes
  (prepare_finalize/deepep_ht.py, deepep_ll.py, deepep_v2.py) with that builder's constructor
  arguments:
  * high-throughput (V1 normal mode, BF16): prepare and finalize, and their async forms;
  * low-latency (V1): BF16 with the receive hook (prepare_async's hook and receiver,
    finalize_async's hook), FP8 (moe-ep casts to E4M3 with per-128 scales) and FP8 with packed
    UE8M0 scales (what post_init_setup selects for experts that take them) through prepare and
    finalize, and the fault-tolerance calls the manager makes on a shrink-mode buffer
    (query_active_mask, query_fault, update_mask, clean_buffers);
  * V2 (ElasticBuffer): prefill (use_cudagraph=False: expanded layout with CPU sync), decode
    (use_cudagraph=True: compact layout, worst-case rows, per-step num_max_tokens_per_rank from the
    forward context's DP metadata) with the globalization of the received ids and with
    defer_globalize (the experts globalize), finalize and finalize_async;
- vLLM's modular kernel, FusedMoEKernel, over the low-latency prepare/finalize with vLLM's
  pure-torch batched experts (NaiveBatchedExperts, SwiGLU), BF16.

Every combined output is compared with the layer computed densely in plain torch (float64) here,
within the BF16 roundings of the path (and, for FP8, of the reference E4M3 cast of
tests/python/reference.py); the received FP8 rows and their scales are compared exactly.

vLLM calls a few CUDA-only kernels of its own around the dispatch; the test supplies plain-torch
stand-ins, written from vLLM's documented formulas, in each process (docs/integration.md lists
them): the ops _moe_C::moe_sum (output[m] = sum over the top-k slots of input[m, j]) and
_C::silu_and_mul (silu(x[:, :d]) * x[:, d:]), registered with torch.library as vLLM's
extension registers them, and deepep_v2._globalize_recv_topk_idx (a Triton kernel: local id + the
rank's expert offset where the slot is local, in range and its row received; -1 elsewhere).
vLLM's compiled extensions need the CUDA driver and are not loaded (vLLM logs that and goes on).
EP_DISABLE_GIN=1 (DeepEP's switch, which vLLM honours) skips vLLM's query of NCCL's GIN support,
which needs NCCL communicators on GPUs. VLLM_DEEPEP_BUFFER_SIZE_MB sizes the V1 buffers down to
what the small shapes need."""

import hashlib

import numpy as np
import pytest
import torch

import reference as ref
from conftest import check_all_ok, run_processes

E, K = 8, 2
H = 2048  # vLLM's low-latency path takes hidden sizes from 2048 (SUPPORTED_HIDDEN_SIZES)
MAX_TOKENS = 8  # per rank: vLLM's max_num_tokens (the low-latency slabs, V2's buffer)
N_INTER = 32  # the modular kernel's experts: intermediate size
NUM_BATCHES = 2


def tokens_of(rank, batch):
    return 1 + (rank * 5 + batch * 3) % 7


def batch_inputs(rank, batch, salt=0):
    g = torch.Generator().manual_seed(9000 + 131 * salt + 17 * batch + rank)
    n = tokens_of(rank, batch)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(n, E, generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, ids.to(torch.int64), weights


def expert_scale(e):
    """Expert e of the dispatch tests: y = bf16(f32(x) * d_e), d_e in [0.5, 1.5)^H."""
    g = torch.Generator().manual_seed(500 + e)
    return 0.5 + torch.rand(H, generator=g)


def mlp_weights(e):
    """Expert e of the modular kernel: w1 [2 * N_INTER, H] (gate; up), w2 [H, N_INTER], BF16 values.
    Positive, as the modular kernel's tokens are (mlp_inputs): no sum cancels, so the bound of the
    roundings stays a few 2^-8 of each value and a term missing or counted twice is far outside it."""
    g = torch.Generator().manual_seed(700 + e)
    w1 = (torch.rand(2 * N_INTER, H, generator=g) * (2 / H)).to(torch.bfloat16)
    w2 = (torch.rand(H, N_INTER, generator=g) * (2 / N_INTER)).to(torch.bfloat16)
    return w1, w2


def mlp_inputs(rank, batch, salt):
    x, ids, weights = batch_inputs(rank, batch, salt)
    return x.abs(), ids, weights


# Plans: name -> (kind, settings). Each runs NUM_BATCHES batches (salted by the plan's index).
PLANS = {
    "ht_bf16": ("ht", {}),
    "ll_bf16_hook": ("ll", dict(fp8=False)),
    "ll_fp8": ("ll", dict(fp8=True)),
    "ll_fp8_ue8m0": ("ll", dict(fp8=True, ue8m0=True)),
    "ll_shrink": ("ll_shrink", {}),
    "v2_prefill": ("v2", dict(cudagraph=False)),
    "v2_decode": ("v2", dict(cudagraph=True)),
    "v2_decode_defer_globalize": ("v2", dict(cudagraph=True, defer_globalize=True)),
    "modular_kernel_ll": ("mk", {}),
}
SALT = {name: i for i, name in enumerate(sorted(PLANS))}


# ---- stand-ins for vLLM's CUDA kernels (registered in each rank's process) ----------------------

_LIBRARIES = []


def _install_stand_ins():
    """Plain-torch versions of the CUDA-only kernels vLLM calls around the dispatch."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_v2

    def moe_sum(input, output, topk_ids=None, expert_map=None):
        # vLLM's moe_sum: output[m, :] = sum over the top-k slots j of input[m, j, :].
        output.copy_(input.float().sum(dim=1))

    def silu_and_mul(result, input):
        # vLLM's silu_and_mul: d = input.shape[-1] // 2; result = silu(input[..., :d]) * input[..., d:].
        d = input.shape[-1] // 2
        x = input.float()
        result.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])

    def globalize_recv_topk_idx(recv_topk_idx, psum_recv_per_rank, rank_expert_offset, num_experts):
        # vLLM's _globalize_recv_topk_idx: a slot keeps local id + offset iff the id is local
        # (>= 0), the global id is below num_experts and its row is below the received count
        # psum[-1]; every other slot becomes -1. In place.
        rows = torch.arange(recv_topk_idx.shape[0]).unsqueeze(1)
        g = recv_topk_idx + rank_expert_offset
        valid = (recv_topk_idx >= 0) & (g < num_experts) & (rows < psum_recv_per_rank[-1])
        recv_topk_idx.copy_(torch.where(valid, g, torch.full_like(g, -1)))
        return recv_topk_idx

    for namespace, schema, fn in (("_moe_C", "moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids, "
                                              "Tensor? expert_map) -> ()", moe_sum),
                                  ("_C", "silu_and_mul(Tensor(a!) result, Tensor input) -> ()", silu_and_mul)):
        name = schema.split("(")[0]
        lib = torch.library.Library(namespace, "FRAGMENT")
        if not hasattr(getattr(torch.ops, namespace), name):  # vLLM's extension was not loaded
            lib.define(schema)
        lib.impl(name, fn, "CPU")
        _LIBRARIES.append(lib)
    deepep_v2._globalize_recv_topk_idx = globalize_recv_topk_idx


# ---- vLLM's distributed state -------------------------------------------------------------------

def _vllm_config(rank, world, **parallel):
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    return VllmConfig(parallel_config=ParallelConfig(data_parallel_size=world, data_parallel_rank=rank,
                                                     enable_expert_parallel=True, **parallel),
                      device_config=DeviceConfig(device="cpu"))


def _init_vllm(rank, world):
    """vLLM's parallel state over the test's gloo world (already initialized: vLLM takes it)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    config = _vllm_config(rank, world)
    with set_current_vllm_config(config):
        ps.init_distributed_environment(1, 0, "env://", local_rank=rank, backend="gloo")
        ps.initialize_model_parallel(1, 1)
    ep = ps.get_ep_group()
    assert ep.world_size == world and ep.rank_in_group == rank and ps.get_dp_group().world_size == world
    return config, ep


# ---- the experts of the dispatch tests ----------------------------------------------------------

def _rows(x, e):
    return (x.float() * expert_scale(e)).to(torch.bfloat16)


def _slot_rows(x, global_ids, first, num_local):
    """[M, k, H] expert outputs of rows x [M, H] with global ids [M, k]: the row's expert where the
    id is one of this rank's, zero elsewhere (vLLM's experts map other ids to nothing)."""
    out = torch.zeros(x.shape[0], global_ids.shape[1], H, dtype=torch.bfloat16)
    for m in range(x.shape[0]):
        for j in range(global_ids.shape[1]):
            e = int(global_ids[m, j])
            if first <= e < first + num_local:
                out[m, j] = _rows(x[m], e)
    return out


def _digest(values):
    return hashlib.sha1(np.ascontiguousarray(values.to(torch.float64).numpy()).tobytes()).hexdigest()


def _to_bytes(t):
    return t.to(torch.float32).contiguous().numpy().tobytes()


# ---- the plans ----------------------------------------------------------------------------------

def _unquantized():
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    return FUSED_MOE_UNQUANTIZED_CONFIG


def _fp8_block_config():
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    return FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])


def _run_ht(rank, world, ep, salt, outputs):
    import deep_ep
    from vllm.distributed.device_communicators.all2all import DeepEPHTAll2AllManager
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import DeepEPHTPrepareAndFinalize

    El = E // world
    manager = DeepEPHTAll2AllManager(ep.cpu_group, None)
    handle = manager.get_handle({})
    assert isinstance(handle, deep_ep.Buffer) and not handle.low_latency_mode
    assert manager.get_handle({}) is handle  # one buffer per set of arguments
    pf = DeepEPHTPrepareAndFinalize(handle, num_dispatchers=manager.world_size, dp_size=manager.dp_world_size,
                                    rank_expert_offset=manager.rank * El)
    manager.set_num_sms(16)
    for b in range(NUM_BATCHES):
        x, ids, weights = batch_inputs(rank, b, salt)
        args = (x, weights, ids, E, None, False, _unquantized())
        if b % 2 == 0:
            expert_x, scale, meta, recv_ids, recv_weights = pf.prepare(*args)
        else:
            expert_x, scale, meta, recv_ids, recv_weights = pf.prepare_async(*args)()
        assert scale is None and expert_x.dtype == torch.bfloat16
        local = (recv_ids >= rank * El) & (recv_ids < (rank + 1) * El)
        counts = [int((recv_ids == rank * El + i).sum()) for i in range(El)]
        assert meta.expert_num_tokens_cpu.tolist() == counts and meta.expert_num_tokens.tolist() == counts
        assert bool((recv_weights[~local] == 0).all())  # DeepEP: weight 0 where the slot is not local
        fused = _slot_rows(expert_x, recv_ids, rank * El, El)
        outputs.append(_to_bytes(_finalize(pf, x, fused, recv_weights, recv_ids, asynchronous=b % 2 == 1)))
    manager.destroy()


def _finalize(pf, x, fused, recv_weights, recv_ids, asynchronous):
    """vLLM's finalize (or finalize_async and its completion) into a fresh output shaped like x."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate
    output = torch.empty_like(x)
    if asynchronous:
        pf.finalize_async(output, fused, recv_weights, recv_ids, False, TopKWeightAndReduceDelegate())()
    else:
        pf.finalize(output, fused, recv_weights, recv_ids, False, TopKWeightAndReduceDelegate())
    return output


def _ll_manager(rank, world, ep, fault_tolerance=False):
    from vllm.config import set_current_vllm_config
    from vllm.distributed.device_communicators.all2all import DeepEPLLAll2AllManager
    with set_current_vllm_config(_vllm_config(rank, world, enable_fault_tolerance=fault_tolerance)):
        manager = DeepEPLLAll2AllManager(ep.cpu_group, None)
    handle = manager.get_handle(dict(max_num_tokens_per_dp_rank=MAX_TOKENS, token_hidden_size=H,
                                     num_ep_ranks=manager.world_size, num_global_experts=E,
                                     num_local_experts=E // manager.world_size))
    assert handle.low_latency_mode and manager.max_sms_used() == 0
    return manager, handle


class _ExpertsTakingPackedScales:
    """What post_init_setup asks of the experts (BatchedDeepGemmExperts answers True on Blackwell)."""

    @staticmethod
    def supports_packed_ue8m0_act_scales():
        return True


def _ll_batches(rank, world, pf, salt, outputs, fp8, ue8m0, digests, batches=range(NUM_BATCHES)):
    """Low-latency batches: BF16 through the hooks (prepare_async's hook and receiver,
    finalize_async's hook), FP8 through prepare and finalize (which run the hooks themselves)."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate
    El = E // world
    quant = _fp8_block_config() if fp8 else _unquantized()
    hooks = not fp8
    for b in batches:
        x, ids, weights = batch_inputs(rank, b, salt)
        if hooks:
            hook, receiver = pf.prepare_async(x, weights, ids, E, None, False, quant)
            hook()  # the receive hook: the dispatch's data arrives here
            expert_x, scale, meta, none_ids, none_weights = receiver()
        else:
            expert_x, scale, meta, none_ids, none_weights = pf.prepare(x, weights, ids, E, None, False, quant)
        assert none_ids is None and none_weights is None and meta.expert_num_tokens_cpu is None
        counts = meta.expert_num_tokens.tolist()
        assert expert_x.shape == (El, world * MAX_TOKENS, H)
        if fp8:
            assert expert_x.dtype == torch.float8_e4m3fn
            if ue8m0:
                assert scale.dtype == torch.int32 and scale.shape == (El, world * MAX_TOKENS, H // 512)
                exps = scale.contiguous().view(torch.uint8).to(torch.float64).reshape(El, -1, H // 128)
                scale_f = torch.pow(2.0, exps - 127)
            else:
                assert scale.dtype == torch.float32 and scale.shape == (El, world * MAX_TOKENS, H // 128)
                scale_f = scale.to(torch.float64)
            values = (expert_x.to(torch.float64).reshape(El, -1, H // 128, 128) * scale_f[..., None]).reshape(
                El, -1, H)
            digests.append([sorted(_digest(values[i, m]) for m in range(counts[i])) for i in range(El)])
        else:
            assert expert_x.dtype == torch.bfloat16 and scale is None
            values = expert_x.float()
        fused = torch.zeros(El, world * MAX_TOKENS, H, dtype=torch.bfloat16)
        for i in range(El):
            fused[i, :counts[i]] = _rows(values[i, :counts[i]], rank * El + i)
        output = torch.empty_like(x)
        if hooks:
            recv_hook, _ = pf.finalize_async(output, fused, weights, ids, False, TopKWeightAndReduceDelegate())
            recv_hook()
        else:
            pf.finalize(output, fused, weights, ids, False, TopKWeightAndReduceDelegate())
        outputs.append(_to_bytes(output))


def _run_ll(rank, world, ep, salt, outputs, fp8=False, ue8m0=False, digests=None):
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize
    manager, handle = _ll_manager(rank, world, ep)
    pf = DeepEPLLPrepareAndFinalize(handle, max_tokens_per_rank=MAX_TOKENS, num_dispatchers=manager.world_size,
                                    use_fp8_dispatch=fp8)
    if ue8m0:
        pf.post_init_setup(_ExpertsTakingPackedScales())
        assert pf.use_ue8m0_dispatch
    _ll_batches(rank, world, pf, salt, outputs, fp8, ue8m0, digests)
    manager.destroy()


def _run_ll_shrink(rank, world, ep, salt, outputs):
    """The fault-tolerance calls vLLM makes on a shrink-mode buffer (its fault sentinel's recovery):
    a batch with every rank; then, with every rank stopped, clean_buffers (the buffer zeroed, the
    mask cleared) and update_mask of the dead rank (the last one here) on every rank; a batch
    without it. The ranks stop together through the EP group's CPU group, as the sentinel's
    recovery rendezvous does."""
    import torch.distributed as dist
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize
    manager, handle = _ll_manager(rank, world, ep, fault_tolerance=True)
    assert manager.support_fault_tolerance
    pf = DeepEPLLPrepareAndFinalize(handle, max_tokens_per_rank=MAX_TOKENS, num_dispatchers=manager.world_size)
    masks = [manager.query_active_mask().tolist(), bool(manager.query_fault())]
    _ll_batches(rank, world, pf, salt, outputs, False, False, None, batches=[0])
    dist.barrier(group=ep.cpu_group)
    manager.clean_buffers()
    dist.barrier(group=ep.cpu_group)
    manager.update_mask(world - 1, True)
    masks += [manager.query_active_mask().tolist(), bool(manager.query_fault())]
    _ll_batches(rank, world, pf, salt, outputs, False, False, None, batches=[1])
    masks += [manager.query_active_mask().tolist(), bool(manager.query_fault())]
    manager.destroy()
    return masks


def _run_v2(rank, world, ep, config, salt, outputs, cudagraph, defer_globalize=False):
    import deep_ep
    from vllm.config import set_current_vllm_config
    from vllm.distributed.device_communicators.all2all import DeepEPV2All2AllManager
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2 import DeepEPV2PrepareAndFinalize

    El = E // world
    manager = DeepEPV2All2AllManager(ep.cpu_group, None, device_group=ep.device_group)
    handle = manager.get_handle(dict(num_max_tokens_per_rank=MAX_TOKENS, hidden=H, num_topk=K, num_experts=E,
                                     use_fp8_dispatch=False))
    assert isinstance(handle, deep_ep.ElasticBuffer) and manager.max_sms_used() == handle.get_theoretical_num_sms(
        num_experts=E, num_topk=K)
    pf = DeepEPV2PrepareAndFinalize(buffer=handle, num_dispatchers=manager.world_size, dp_size=manager.dp_world_size,
                                    rank_expert_offset=manager.rank * El, num_experts=E, num_topk=K,
                                    use_fp8_dispatch=False, use_cudagraph=cudagraph, sp_size=1)
    pf.defer_globalize = defer_globalize  # what FusedMoEKernel sets for experts that globalize themselves
    for b in range(NUM_BATCHES):
        x, ids, weights = batch_inputs(rank, b, salt)
        with set_current_vllm_config(config), set_forward_context(None, config, num_tokens=x.shape[0]):
            expert_x, scale, meta, recv_ids, recv_weights = pf.prepare(x, weights, ids, E, None, False,
                                                                        _unquantized())
        assert scale is None
        if not cudagraph:
            # Expanded: expert i's rows in a run of meta.expert_num_tokens[i] rows, ids global.
            counts = meta.expert_num_tokens_cpu.tolist()
            assert recv_ids.shape == (sum(counts), 1) and recv_ids.flatten().tolist() == sum(
                ([rank * El + i] * c for i, c in enumerate(counts)), [])
            fused = _slot_rows(expert_x, recv_ids, rank * El, El)
        else:
            num_recv = int(meta.psum_recv_per_rank[-1])
            assert meta.expert_num_tokens is None and recv_ids.shape[1] == K
            # The worst case for the step: every rank's tokens, the DP maximum rounded up to a power of 2.
            step_max = max(tokens_of(r, b) for r in range(world))
            assert expert_x.shape[0] == world * (1 << (step_max - 1).bit_length())
            ids_seen = recv_ids[:num_recv].clone()
            if defer_globalize:
                assert meta.rank_expert_offset == rank * El
                local = ids_seen >= 0
                ids_seen = torch.where(local, ids_seen + rank * El, ids_seen)  # the experts' own globalization
            else:
                # Globalized: local slots hold global ids, every other slot and every row past the
                # received ones -1.
                assert getattr(meta, "rank_expert_offset", None) is None
                assert bool((recv_ids[num_recv:] == -1).all())
                assert bool(((recv_ids[:num_recv] == -1) | ((recv_ids[:num_recv] >= rank * El)
                                                            & (recv_ids[:num_recv] < (rank + 1) * El))).all())
            fused = torch.zeros(expert_x.shape[0], K, H, dtype=torch.bfloat16)
            fused[:num_recv] = _slot_rows(expert_x[:num_recv], ids_seen, rank * El, El)
        outputs.append(_to_bytes(_finalize(pf, x, fused, recv_weights, recv_ids, asynchronous=b % 2 == 1)))
    manager.destroy()


def _run_modular_kernel(rank, world, ep, salt, outputs):
    """FusedMoEKernel(DeepEPLLPrepareAndFinalize, NaiveBatchedExperts), as vLLM's FusedMoE layer runs
    its low-latency path."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import NaiveBatchedExperts
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize
    from vllm.v1.worker.workspace import init_workspace_manager

    El = E // world
    manager, handle = _ll_manager(rank, world, ep)
    parallel = FusedMoEParallelConfig.make(
        tp_size_=1, pcp_size_=1, dp_size_=world, sp_size_=1,
        vllm_parallel_config=_vllm_config(rank, world, all2all_backend="deepep_low_latency").parallel_config)
    assert parallel.use_deepep_ll_kernels and parallel.ep_rank == rank
    moe = FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=N_INTER,
                         num_local_experts=El, num_logical_experts=E, activation=MoEActivation.SILU,
                         device="cuda", routing_method=RoutingMethodType.TopK, moe_parallel_config=parallel,
                         in_dtype=torch.bfloat16, max_num_tokens=MAX_TOKENS)
    pf = DeepEPLLPrepareAndFinalize(handle, max_tokens_per_rank=MAX_TOKENS, num_dispatchers=manager.world_size)
    experts = NaiveBatchedExperts(moe, _unquantized(), max_num_tokens=MAX_TOKENS, num_dispatchers=world)
    kernel = FusedMoEKernel(pf, experts)
    init_workspace_manager(torch.device("cuda", rank))  # as vLLM's GPU worker does at start-up
    w1 = torch.stack([mlp_weights(rank * El + i)[0] for i in range(El)])
    w2 = torch.stack([mlp_weights(rank * El + i)[1] for i in range(El)])
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[rank * El:(rank + 1) * El] = torch.arange(El, dtype=torch.int32)
    for b in range(NUM_BATCHES):
        x, ids, weights = mlp_inputs(rank, b, salt)
        out = kernel.apply(hidden_states=x, w1=w1, w2=w2, topk_weights=weights, topk_ids=ids,
                           activation=MoEActivation.SILU, global_num_experts=E, expert_map=expert_map,
                           apply_router_weight_on_input=False)
        outputs.append(_to_bytes(out))
    manager.destroy()


def vllm_layer(rank, world, group):
    """Every plan in turn, in one set of processes (vLLM takes seconds to import)."""
    import deep_ep.cpu_compat
    deep_ep.cpu_compat.install()
    _install_stand_ins()
    config, ep = _init_vllm(rank, world)
    results = {}
    for name in sorted(PLANS):
        kind, settings = PLANS[name]
        outputs, digests, extra = [], [], None
        salt = SALT[name]
        if kind == "ht":
            _run_ht(rank, world, ep, salt, outputs)
        elif kind == "ll":
            _run_ll(rank, world, ep, salt, outputs, digests=digests, **settings)
        elif kind == "ll_shrink":
            extra = _run_ll_shrink(rank, world, ep, salt, outputs)
        elif kind == "v2":
            _run_v2(rank, world, ep, config, salt, outputs, **settings)
        else:
            _run_modular_kernel(rank, world, ep, salt, outputs)
        results[name] = dict(outputs=outputs, digests=digests, extra=extra)
    return dict(plans=results, compat_calls=deep_ep.cpu_compat.calls())


# ---- the dense reference ------------------------------------------------------------------------

def _source_values(x, fp8, ue8m0):
    """The values the experts see for rows x: BF16 values, or their E4M3 cast times its scales."""
    if not fp8:
        return x.double()
    q, scale_inv = ref.fp8_block_cast(x, round_scale=ue8m0)
    s = scale_inv.double().numpy()
    return torch.as_tensor((q.reshape(x.shape[0], -1, 128) * s[:, :, None]).reshape(x.shape), dtype=torch.float64)


def reference_output(rank, batch, salt, fp8=False, ue8m0=False, world=None, masked=()):
    """out[t] = sum_j w_tj * (x_t * d_e(tj)) in float64, and the sum of the magnitudes of its terms.
    masked: ranks left out (shrink mode): their experts' lanes, and every lane of their own tokens."""
    x, ids, weights = batch_inputs(rank, batch, salt)
    xs = _source_values(x, fp8, ue8m0)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for t in range(x.shape[0]):
        for j in range(K):
            if rank in masked or int(ids[t, j]) // (E // world if world else E) in masked:
                continue
            term = weights[t, j].double() * xs[t] * expert_scale(int(ids[t, j])).double()
            out[t] += term
            bound[t] += term.abs()
    return out, bound


def reference_mlp(rank, batch, salt):
    """The SwiGLU experts' layer in float64 and a bound of its BF16 roundings. NaiveBatchedExperts
    rounds the first matmul's outputs (gate g, up), silu_and_mul's h and the second matmul's y to
    BF16, each within 2^-8 of its value (the matmuls accumulate n terms in FP32: n 2^-24 more of the
    sum of their magnitudes, here the sum itself: every value is positive), silu's derivative is
    below 1.1 there, and the combine rounds the weighted sum once more."""
    x, ids, weights = mlp_inputs(rank, batch, salt)
    xs = x.double()
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    bound = torch.zeros_like(out)
    u = 2.0 ** -8
    for t in range(x.shape[0]):
        for j in range(K):
            w1, w2 = (w.double() for w in mlp_weights(int(ids[t, j])))
            gu = w1 @ xs[t]
            g, up = gu[:N_INTER], gu[N_INTER:]
            silu = torch.nn.functional.silu(g)
            h = silu * up
            e_g, e_up = (u + H * 2.0 ** -24) * g, (u + H * 2.0 ** -24) * up  # the first matmul
            e_h = 1.1 * e_g * (up + e_up) + silu * e_up
            e_h = e_h + u * (h + e_h)  # silu_and_mul
            y = w2 @ h
            e_y = w2 @ e_h + (u + N_INTER * 2.0 ** -24) * (w2 @ (h + e_h))  # the second matmul
            w = weights[t, j].double()
            out[t] += w * y
            bound[t] += w * (e_y + u * (w2 @ (h + e_h)) * 1.01)  # the combine
    return out, bound


def _check(got_bytes, expected, limit, what):
    got = torch.from_numpy(np.frombuffer(got_bytes, dtype=np.float32).copy()).double().reshape(-1, H)
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    err = (got - expected).abs()
    assert (err <= limit).all(), f"{what}: off by {err.max().item():.3g} (limit {limit.max().item():.3g})"


def _expected_digests(world, rank, batch, salt, ue8m0):
    """Per local expert of `rank`: the digests of the rows routed to it (E4M3 values times scales)."""
    El = E // world
    per_expert = [[] for _ in range(El)]
    for src in range(world):
        x, ids, _ = batch_inputs(src, batch, salt)
        values = _source_values(x, True, ue8m0)
        for t in range(x.shape[0]):
            for j in range(K):
                e = int(ids[t, j])
                if e // El == rank:
                    per_expert[e % El].append(_digest(values[t]))
    return [sorted(d) for d in per_expert]


@pytest.mark.parametrize("world", [2, 4])
def test_vllm_deepep_all2all_and_prepare_finalize(world):
    env = {"EP_DISABLE_GIN": "1", "VLLM_DEEPEP_BUFFER_SIZE_MB": "64", "VLLM_LOGGING_LEVEL": "WARNING"}
    results = check_all_ok(run_processes(vllm_layer, world, env=env, timeout=600))
    for r, res in enumerate(results):
        calls = res["compat_calls"]
        assert calls.get("torch.accelerator.current_stream", 0) >= 1, calls  # NaiveBatchedExperts asks it
        for name in sorted(PLANS):
            kind, settings = PLANS[name]
            got = res["plans"][name]
            salt = SALT[name]
            assert len(got["outputs"]) == NUM_BATCHES, name
            fp8, ue8m0 = settings.get("fp8", False), settings.get("ue8m0", False)
            for b in range(NUM_BATCHES):
                what = f"{name}, rank {r}, batch {b}"
                if kind == "mk":
                    expected, limit = reference_mlp(r, b, salt)
                    _check(got["outputs"][b], expected, limit + 1e-6, what)
                    continue
                masked = (world - 1,) if kind == "ll_shrink" and b == 1 else ()
                expected, bound = reference_output(r, b, salt, fp8, ue8m0, world, masked)
                # Up to four BF16 roundings (expert rows, their weighting, the sum over a rank's
                # slots, the combine), each within 2^-8 of its value (BF16 keeps 8 significant
                # bits), every value within the sum of the magnitudes of the terms; FP8 values are
                # the reference's own cast. A term missing or counted twice is off by far more.
                _check(got["outputs"][b], expected, 4 * 2 ** -8 * bound + 1e-6, what)
                if fp8:
                    assert got["digests"][b] == _expected_digests(world, r, b, salt, ue8m0), \
                        f"{what}: the received FP8 rows differ from the E4M3 cast of the tokens routed there"
        # The fault-tolerance calls: all ranks active; the last one masked after update_mask, which
        # vLLM records, so no fault is reported. After a batch the masked rank also masks every
        # rank that masked it (as DeepEP's receive timeout does), which its query_fault reports.
        active, masked = [0] * world, [0] * (world - 1) + [1]
        after = [1] * world if r == world - 1 else masked
        assert res["plans"]["ll_shrink"]["extra"] == [active, False, masked, False, after, r == world - 1], r
