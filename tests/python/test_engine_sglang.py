"""SGLang's own DeepEP token dispatchers on moe-ep, unmodified, on 2 and 4 CPU processes over gloo,
with ``deep_ep`` resolving to moe-ep through the alias directory (build tree) or the wheel's switch (installed), and moe_ep.deep_ep.cpu_compat
installed (SGLang sizes its V1 buffer with torch.cuda.get_device_properties):

- sglang.srt.layers.moe.token_dispatcher.deepep.DeepEPDispatcher (V1 Buffer) in auto mode over a
  sequence of prefill ("extend") and decode batches — normal mode, low-latency mode, the
  normal -> low-latency buffer cleaning — with async_finish and the receive hook, BF16; in
  low-latency mode with FP8 (moe-ep casts to E4M3 with per-128 scales); and in normal mode, whose
  buffer SGLang sizes with DeepEP's hints alone (num_rdma_bytes = 0 on up to 8 ranks, also where
  MOE_EP_RANKS_PER_NODE=2 makes two logical nodes of the 4 ranks: the Buffer then provides its
  scale-out pool itself, docs/legacy.md §1). Each V1 plan builds its own buffer, sized for its
  mode as a deployment with that mode sizes it;
- sglang.srt.layers.moe.token_dispatcher.deepep_v2.DeepEPv2Dispatcher (V2 ElasticBuffer, SGLang's
  deepep_v2 backend): expanded prefill with CPU sync, masked decode without, compact prefill
  (SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND=0), and a rank without tokens; direct mode on 2
  processes, hybrid mode on 4 (two logical nodes, MOE_EP_RANKS_PER_NODE=2).

Each rank runs a linear expert per local expert on what the dispatcher hands it, in the layout
the dispatcher's format promises, and combines. The combined output of every batch is compared
with the layer computed densely in plain torch (float64) here, within the BF16 roundings of the
path (and, for FP8, of the reference E4M3 cast of tests/python/reference.py).

SGLang's configuration: the server arguments a deployment would pass (moe_a2a_backend,
deepep_mode / deepep_v2_mode, deepep_dispatcher_output_dtype) are published as SGLang does at
start-up; its normal-mode combine is wired for the DeepGEMM runner only, which the test declares
with deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True (with BF16 dispatch nothing else depends on it
but the expert alignment of 128)."""

import pytest
import torch

import reference as ref
from conftest import check_all_ok, run_processes

E, K, H = 8, 2, 256
ALIGN = 128  # SGLang's expert alignment with the DeepGEMM runner (both generations)


def tokens_of(rank, batch):
    return 3 + (rank * 5 + batch * 3) % 7


def batch_inputs(rank, batch, empty_ranks=()):
    g = torch.Generator().manual_seed(5000 + 97 * batch + rank)
    n = 0 if rank in empty_ranks else tokens_of(rank, batch)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(n, E, generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, ids, weights, logits


def expert_weight(e):
    g = torch.Generator().manual_seed(311 + e)
    return torch.randn(H, H, generator=g) / H ** 0.5


# Each plan: (generation, dispatcher settings, batches [(is_extend, empty ranks)]).
PLANS = {
    "v1_auto_bf16": ("v1", dict(deepep_mode="auto", async_finish=True, return_recv_hook=True),
                     [(True, ()), (False, ()), (False, ()), (True, ()), (False, ())]),
    "v1_low_latency_fp8": ("v1", dict(deepep_mode="low_latency", async_finish=False, return_recv_hook=False,
                                      output_dtype="fp8"), [(False, ()), (False, ())]),
    "v1_normal_bf16": ("v1", dict(deepep_mode="normal", async_finish=True, return_recv_hook=False),
                       [(True, ()), (True, ())]),
    "v2_expanded": ("v2", dict(prefill_expand=True), [(True, ()), (False, ()), (True, (1,)), (False, (1,))]),
    "v2_compact": ("v2", dict(prefill_expand=False), [(True, ()), (True, (0,)), (False, ())]),
}


def _publish(backend, **server_args):
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu", skip_tokenizer_init=True,
                                                    moe_a2a_backend=backend, **server_args))


def _expert_rows(rows, e, weight=None):
    y = rows.float() @ expert_weight(e)
    return y if weight is None else y * weight[:, None]


def _dispatch_batch(dispatcher, rank, batch, extend, empty):
    """SGLang's forward-batch flag, then the dispatcher's dispatch of this rank's tokens."""
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    set_is_extend_in_batch(extend)
    x, ids, weights, logits = batch_inputs(rank, batch, empty)
    return dispatcher.dispatch(x, StandardTopKOutput(topk_weights=weights, topk_ids=ids.to(torch.int32),
                                                     router_logits=logits))


def _compact_rows(hidden, local_ids, weights, rank, El):
    """The runner on rows with local expert ids (-1 elsewhere): sum over the row's local experts of
    weight * expert(row), rounded to BF16 once."""
    y = torch.zeros(hidden.shape[0], H)
    for j in range(K):
        for i in range(El):
            sel = local_ids[:, j] == i
            y[sel] += _expert_rows(hidden[sel], rank * El + i, weights[sel, j])
    return y.to(torch.bfloat16)


def _dequantize(data, scales):
    """The runner's view of an FP8 slab: E4M3 values times their per-128 scales."""
    values = data.float()
    return (values.reshape(*values.shape[:-1], -1, 128) * scales.float()[..., None]).reshape(values.shape)


def _fresh_v1_buffer():
    """Drops SGLang's process-wide V1 buffer, so that the next dispatcher sizes its own for its mode.
    Every rank drops it at the same point (its destruction is collective)."""
    from sglang.srt.runtime_context import get_resources
    state = get_resources().buffers.pop("deepep_ep_state", None)
    if state is not None:
        state.buffer = None


def _run_v1(rank, world, group, settings, batches):
    import deep_ep
    import moe_ep
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe.token_dispatcher import deepep as sg
    from sglang.srt.layers.moe.utils import DeepEPMode

    assert sg.use_deepep and sg.Buffer is moe_ep.deep_ep.Buffer is deep_ep.Buffer
    _publish("deepep", deepep_mode=settings["deepep_mode"],
             deepep_dispatcher_output_dtype=settings.get("output_dtype", "bf16"))
    _fresh_v1_buffer()
    deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True
    El = E // world
    dispatcher = sg.DeepEPDispatcher(group=group, router_topk=K, num_experts=E, num_local_experts=El, hidden_size=H,
                                     params_dtype=torch.bfloat16, deepep_mode=DeepEPMode(settings["deepep_mode"]),
                                     async_finish=settings["async_finish"],
                                     return_recv_hook=settings["return_recv_hook"])
    outputs = []
    for b, (extend, empty) in enumerate(batches):
        out = _dispatch_batch(dispatcher, rank, b, extend, empty)
        if type(out).__name__ == "DeepEPNormalDispatchOutput":
            assert extend and out.hidden_states_scale is None
            counts = [int((out.topk_ids == i).sum()) for i in range(El)]
            assert list(out.num_recv_tokens_per_expert) == [-(-c // ALIGN) * ALIGN for c in counts]
            y = _compact_rows(out.hidden_states, out.topk_ids, out.topk_weights, rank, El)
            combined = dispatcher.combine(sg.DeepEPNormalCombineInput(y, out.topk_ids, out.topk_weights))
        else:
            assert type(out).__name__ == "DeepEPLLDispatchOutput" and not (extend and settings["deepep_mode"] == "auto")
            if settings.get("output_dtype") == "fp8":
                assert out.hidden_states.dtype == torch.float8_e4m3fn and out.hidden_states_scale is not None
                slab = _dequantize(out.hidden_states, out.hidden_states_scale)
            else:
                assert out.hidden_states.dtype == torch.bfloat16 and out.hidden_states_scale is None
                slab = out.hidden_states.float()
            y = torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16)
            for i in range(El):
                m = int(out.masked_m[i])
                y[i, :m] = _expert_rows(slab[i, :m], rank * El + i).to(torch.bfloat16)
            combined = dispatcher.combine(sg.DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights))
        outputs.append(dict(format=type(out).__name__, out=combined.float().tolist()))
    return outputs


def _run_v2(rank, world, group, settings, batches):
    import os

    import deep_ep
    import moe_ep
    os.environ["SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND"] = "1" if settings["prefill_expand"] else "0"
    from sglang.srt.layers.moe.token_dispatcher import deepep_v2 as sg

    assert sg.use_deepep_v2 and sg.ElasticBuffer is moe_ep.deep_ep.ElasticBuffer is deep_ep.ElasticBuffer
    hybrid = moe_ep.resolve_group(group).num_scaleout > 1
    _publish("deepep_v2", deepep_v2_mode="hybrid" if hybrid else "direct")
    El = E // world
    dispatcher = sg.DeepEPv2Dispatcher(group=group, router_topk=K, num_experts=E, num_local_experts=El, hidden_size=H,
                                       params_dtype=torch.bfloat16, use_fp8_dispatch=False)
    outputs = []
    for b, (extend, empty) in enumerate(batches):
        out = _dispatch_batch(dispatcher, rank, b, extend, empty)
        assert out.use_masked_gemm == (not extend) and out.expert_alignment == ALIGN
        if out.is_expanded:
            # Expert i's rows: [align(psum[i-1]), psum[i]); the rest is padding.
            psum = out.psum_num_recv_tokens_per_expert.tolist()
            y = torch.zeros(out.hidden_states.shape[0], H, dtype=torch.bfloat16)
            start = 0
            for i, end in enumerate(psum):
                rows = slice(start, end)
                y[rows] = _expert_rows(out.hidden_states[rows], rank * El + i, out.topk_weights[rows]).to(torch.bfloat16)
                start = -(-end // ALIGN) * ALIGN
        else:
            assert extend and out.topk_ids.shape == (out.hidden_states.shape[0], K)
            y = _compact_rows(out.hidden_states, out.topk_ids, out.topk_weights, rank, El)
        combined = dispatcher.combine(sg.DeepEPv2CombineInput(y, None))
        outputs.append(dict(format=("expanded" if out.is_expanded else "compact") + ("_masked" if out.use_masked_gemm
                                                                                      else ""),
                            out=combined.float().tolist()))
    return outputs


def sglang_layer(rank, world, group):
    """Every plan in turn, in one set of processes (SGLang takes seconds to import)."""
    import deep_ep.cpu_compat
    deep_ep.cpu_compat.install()
    results = {}
    for plan, (generation, settings, batches) in sorted(PLANS.items()):
        run = _run_v1 if generation == "v1" else _run_v2
        results[plan] = run(rank, world, group, settings, batches)
    return dict(plans=results, compat_calls=deep_ep.cpu_compat.calls())


def reference_output(rank, batch, empty, fp8):
    x, ids, weights, _ = batch_inputs(rank, batch, empty)
    xs = x.double()
    if fp8:
        q, scale_inv = ref.fp8_block_cast(x)
        xs = torch.as_tensor((q.reshape(x.shape[0], -1, 128) * scale_inv.double().numpy()[:, :, None]).reshape(x.shape),
                             dtype=torch.float64)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            term = weights[t, j].double() * (xs[t] @ expert_weight(e).double())
            out[t] += term
            bound[t] += (weights[t, j].double() * (xs[t].abs() @ expert_weight(e).double().abs()))
    return out, bound


def expected_format(generation, settings, extend):
    """What SGLang hands its MoE runner for this batch."""
    if generation == "v1":
        normal = settings["deepep_mode"] == "normal" or (settings["deepep_mode"] == "auto" and extend)
        return "DeepEPNormalDispatchOutput" if normal else "DeepEPLLDispatchOutput"
    if not extend:
        return "expanded_masked"
    return "expanded" if settings["prefill_expand"] else "compact"


@pytest.mark.parametrize("world", [2, 4])
def test_sglang_deepep_dispatchers(world):
    env = {"MOE_EP_RANKS_PER_NODE": "2"} if world == 4 else {}
    results = check_all_ok(run_processes(sglang_layer, world, env=env, timeout=600))
    for r, res in enumerate(results):
        # What SGLang's DeepEP paths asked of the compatibility layer.
        assert res["compat_calls"].get("torch.cuda.get_device_properties", 0) >= 1, res["compat_calls"]
        for plan, (generation, settings, batches) in sorted(PLANS.items()):
            fp8 = settings.get("output_dtype") == "fp8"
            for b, (extend, empty) in enumerate(batches):
                got_batch = res["plans"][plan][b]
                got = torch.tensor(got_batch["out"], dtype=torch.float64).reshape(-1, H)
                expected, bound = reference_output(r, b, empty, fp8)
                what = f"{plan}, rank {r}, batch {b} ({got_batch['format']})"
                assert got_batch["format"] == expected_format(generation, settings, extend), what
                assert got.shape == expected.shape, what
                # Up to four BF16 roundings (expert rows, partial sums per rank and node, the final
                # sum); FP8 values are the reference's own cast, their products summed in FP32.
                limit = 4 * 2 ** -9 * bound + 1e-6
                err = (got - expected).abs()
                assert (err <= limit).all(), f"{what}: off by {err.max().item():.3g}"
