"""Dispatchers written the way engines call DeepEP (deepep-python-api.md §2,
framework-dispatchers.md §1-2), importing `deep_ep` through the alias directory or the wheel's switch, run on
LocalWorld threads and over 2 gloo processes; results checked against the reference."""

import pytest
import torch

import moe_ep
from deep_ep import Buffer, Config, ElasticBuffer  # noqa: F401  (the engines' imports)
from deep_ep.utils import EventHandle, EventOverlap

import reference as ref
import scenarios
from conftest import check_all_ok, run_processes
from scenarios import assert_same

H, E, K, CAP = 256, 16, 4, 16


class SGLangDeepEPDispatcher:
    """SGLang's V1 `deepep.py`: one Buffer for normal and low-latency batches (auto mode)."""

    def __init__(self, group, hidden, num_experts, cap):
        self.group, self.hidden, self.num_experts, self.cap = group, hidden, num_experts, cap
        R = group.size()
        nvl = rdma = 0
        for config in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)):
            nvl = max(config.get_nvl_buffer_size_hint(hidden * 2, R), nvl)
            rdma = max(config.get_rdma_buffer_size_hint(hidden * 2, R), rdma)
        rdma = max(Buffer.get_low_latency_rdma_size_hint(cap, hidden, R, num_experts), rdma)
        num_qps = max(Buffer.num_sms, num_experts // R)
        self.buffer = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=num_qps, allow_mnnvl=True)
        self.last_mode = None
        self.handle = None

    # normal (prefill / extend)
    def normal_dispatch(self, x, topk_idx, topk_weights):
        self.last_mode = "normal"
        R = self.group.size()
        previous_event = Buffer.capture()
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = self.buffer.get_dispatch_layout(topk_idx, self.num_experts, previous_event=previous_event,
                                                           async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, self.handle, event = \
            self.buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                 num_tokens_per_rank=num_tokens_per_rank,
                                 num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                                 is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                                 previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True,
                                 expert_alignment=1, config=Buffer.get_dispatch_config(R))
        event.current_stream_wait()
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list

    def normal_combine(self, x):
        previous_event = Buffer.capture()
        combined_x, _, event = self.buffer.combine(x, self.handle, async_finish=True, previous_event=previous_event,
                                                   allocate_on_comm_stream=True,
                                                   config=Buffer.get_combine_config(self.group.size()))
        event.current_stream_wait()
        self.handle = None
        return combined_x

    # low latency (decode)
    def ll_dispatch(self, x, topk_idx):
        if self.last_mode == "normal":
            self.buffer.clean_low_latency_buffer(self.cap, self.hidden, self.num_experts)
        self.last_mode = "low_latency"
        recv_hidden, masked_m, self.handle, event, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, self.cap, self.num_experts, use_fp8=False, async_finish=False, return_recv_hook=True)
        hook()
        expected_m = (x.shape[0] * self.group.size() * topk_idx.shape[1] + self.num_experts) // self.num_experts
        return recv_hidden, masked_m, expected_m

    def ll_combine(self, y, topk_idx, topk_weights):
        combined, event, hook = self.buffer.low_latency_combine(y, topk_idx, topk_weights, self.handle,
                                                                async_finish=False, return_recv_hook=True)
        hook()
        self.handle = None
        return combined


def sglang_v1(group):
    rank, R = group.rank(), group.size()
    El = E // R
    d = SGLangDeepEPDispatcher(group, H, E, CAP)
    for step, phase in enumerate(["extend", "decode", "decode", "extend", "decode"]):
        inputs = ref.make_inputs(R, 12, H, E, K, 200 + step)
        x, idx, w = inputs[rank]
        if phase == "extend":
            recv_x, recv_idx, recv_w, counts = d.normal_dispatch(x, idx, w)
            exp = ref.v1_dispatch(inputs, rank, E)
            assert_same(recv_x, exp["recv_x"], "SGLang normal recv_x")
            assert_same(recv_idx, exp["recv_topk_idx"], "SGLang normal recv_topk_idx")
            assert_same(recv_w, exp["recv_topk_weights"], "SGLang normal recv_topk_weights")
            assert counts == exp["num_recv_tokens_per_expert_list"]
            out = d.normal_combine(ref.rank_transform(recv_x, rank))
            want = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda dd, t: ref.rank_transform(x[t], dd),
                                    ranks_per_node=group_su(group))
        else:
            slab, masked_m, expected_m = d.ll_dispatch(x, idx)
            per = ref.ll_expert_tokens(inputs, rank, E)
            assert masked_m.tolist() == [len(p) for p in per]
            src = d.handle[0]
            y = torch.zeros_like(slab)
            for i, p in enumerate(per):
                rows = src[i, :len(p)].tolist()
                # rows of one source come in one block; their tokens are that source's tokens for this expert
                assert sorted(rows) == sorted(t for _, t in p)
                y[i, :len(p)] = ref.expert_transform(slab[i, :len(p)], rank * El + i)
                if p:
                    assert_same(slab[i, :len(p)], torch.stack([inputs[s][0][t] for s, t in p]), "SGLang LL slab")
            out = d.ll_combine(y, idx, w)
            want = ref.ll_combine(inputs, rank, E, lambda t, e: ref.expert_transform(x[t], e))
        assert_same(out, want, f"SGLang {phase} combined")
    return True


def megatron_v2(group):
    """Megatron-LM dev's DeepEP V2 path: size hint, ElasticBuffer, async dispatch with a captured event,
    combine; the backward passes: combine of gradients and a cached dispatch."""
    rank, R = group.rank(), group.size()
    T = 16
    num_bytes = ElasticBuffer.get_buffer_size_hint(group, T, H, K)
    assert num_bytes > 0 and num_bytes % (2 << 20) == 0
    buffer = ElasticBuffer(group, num_bytes=num_bytes, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    assert buffer.num_bytes == num_bytes
    inputs = ref.make_inputs(R, 12, H, E, K, 300)
    x, idx, w = inputs[rank]
    # forward dispatch
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=T, expert_alignment=1, num_sms=0,
        previous_event=buffer.capture(), async_with_compute_stream=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    exp = ref.v2_dispatch_compact(inputs, rank, E)
    assert_same(recv_x, exp["recv_x"], "Megatron recv_x")
    assert_same(recv_idx, exp["recv_topk_idx"], "Megatron recv_topk_idx")
    assert_same(recv_w, exp["recv_topk_weights"], "Megatron recv_topk_weights")
    tokens_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list)
    assert tokens_per_expert.tolist() == exp["counts"]
    saved_num_sms = handle.num_sms
    # forward combine
    y = ref.rank_transform(recv_x, rank)
    combined, _, event = buffer.combine(y, handle, previous_event=buffer.capture(), async_with_compute_stream=True,
                                        allocate_on_comm_stream=True)
    event.current_stream_wait()
    want = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda dd, t: ref.rank_transform(x[t], dd),
                            ranks_per_node=group_su(group))
    assert_same(combined, want, "Megatron combined")
    # backward of combine = cached dispatch of the gradient
    grad = ref.make_inputs(R, 12, H, E, K, 301)
    grad_recv, _, _, h2, event = buffer.dispatch(grad[rank][0], handle=handle, num_sms=saved_num_sms)
    assert h2 is handle
    assert_same(grad_recv, torch.stack([grad[s][0][t] for s, t in exp["rows"]]), "Megatron cached dispatch")
    # backward of dispatch = combine of the gradient, the probabilities' gradients transported back
    grad_probs = recv_w * 0.5
    g_x, g_probs, _ = buffer.combine(grad_recv, handle, topk_weights=grad_probs.float(), num_sms=saved_num_sms)
    assert_same(g_x, ref.combine_rank(inputs, rank, E, rank_rows_of=lambda dd, t: grad[rank][0][t],
                                      ranks_per_node=group_su(group)), "Megatron grad")
    assert_same(g_probs, ref.v2_combined_weights(inputs, rank, E, lambda dd, t, j: w[t, j] * 0.5),
                "Megatron grad probs")
    return True


def sglang_v2(group, use_fp8):
    rank, R = group.rank(), group.size()
    El = E // R
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=CAP, hidden=H, num_topk=K, use_fp8_dispatch=use_fp8,
                           allow_hybrid_mode=True, sl_idx=0, prefer_overlap_with_compute=False)
    num_sms = buffer.get_theoretical_num_sms(E, K)
    assert isinstance(num_sms, int) and num_sms >= 1
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    assert num_qps == min(16 * num_sms + 1, buffer.num_allocated_qps), (num_sms, num_qps)
    for step, phase in enumerate(["extend", "decode", "extend", "decode"]):
        inputs = ref.make_inputs(R, 12, H, E, K, 400 + step)
        x, idx, w = inputs[rank]
        pairs = [scenarios._fp8_pair(inputs[s][0], s) for s in range(R)] if use_fp8 else None
        xin = pairs[rank] if use_fp8 else x
        decode = phase == "decode"
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
            xin, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=CAP,
            expert_alignment=8 if decode else 1, num_sms=num_sms, num_qps=num_qps,
            use_tma_aligned_col_major_sf=False, do_cpu_sync=not decode, do_expand=decode)
        payload = (lambda s: pairs[s][0]) if use_fp8 else (lambda s: inputs[s][0])
        data = recv_x[0] if use_fp8 else recv_x
        if not decode:
            M = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
            exp = ref.v2_dispatch_compact(inputs, rank, E, payload=payload)
            assert M == len(exp["rows"])
            assert_same(data[:M], exp["recv_x"], "SGLang V2 extend recv_x")
            assert_same(recv_idx[:M], exp["recv_topk_idx"], "SGLang V2 extend topk ids")
            y = ref.rank_transform(torch.stack([inputs[s][0][t] for s, t in exp["rows"]]), rank)
            combined, _, _ = buffer.combine(y, handle)
            want = ref.combine_rank(inputs, rank, E, rank_rows_of=lambda dd, t: ref.rank_transform(x[t], dd),
                                    ranks_per_node=group_su(group))
        else:
            exp = ref.v2_dispatch_expanded(inputs, rank, E, 8)
            assert handle.num_unaligned_recv_tokens_per_expert.tolist() == exp["counts"]
            y = torch.zeros(data.shape[0], H, dtype=torch.bfloat16)
            for i in range(El):
                st = exp["starts"][i]
                for r, (s, t, j) in enumerate(exp["per_expert"][i]):
                    assert torch.equal(data[st + r], payload(s)[t]), f"SGLang V2 decode row {st + r}"
                    y[st + r] = ref.bf16(recv_w[st + r] * ref.expert_transform(inputs[s][0][t], rank * El + i).float())
            combined, _, _ = buffer.combine(y, handle, topk_weights=None)
            want = ref.combine_rank(inputs, rank, E, lane_rows_of=lambda t, j: ref.bf16(
                w[t, j] * ref.expert_transform(x[t], int(idx[t, j])).float()), ranks_per_node=group_su(group))
        assert_same(combined, want, f"SGLang V2 {phase} combined")
    return True


def group_su(group):
    g = moe_ep.resolve_group(group)
    return g.num_scaleup if g.num_scaleout > 1 else None


ENGINES = {"sglang_v1": sglang_v1, "megatron_v2": megatron_v2,
           "sglang_v2_bf16": lambda g: sglang_v2(g, False), "sglang_v2_fp8": lambda g: sglang_v2(g, True)}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("n,so", [pytest.param(2, 1, id="2x1"), pytest.param(4, 2, id="2x2")])
def test_engine_on_threads(engine, n, so):
    assert moe_ep.LocalWorld(n, so).run(ENGINES[engine]) == [True] * n


def _engine_in_process(rank, world, group, engine):
    import deep_ep
    assert deep_ep.__name__ == "moe_ep.deep_ep"
    return ENGINES[engine](group)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_engine_over_processes(engine):
    assert check_all_ok(run_processes(_engine_in_process, 2, args=(engine,))) == [True, True]
