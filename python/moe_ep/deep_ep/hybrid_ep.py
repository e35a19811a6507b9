"""``Buffer`` with the low-latency signatures of DeepEP's ``hybrid-ep`` branch (the ones SGLang and
vLLM call when they pass ``topk_weights`` or NVFP4 arguments).

``low_latency_dispatch(..., topk_weights=...)`` returns the 7-tuple ``(recv_x, recv_count,
recv_topk_weights [L, R*N] float32, recv_rank_info [L, R*N] int32, handle, event, hook)``: for each
received row, the weight its source token gave this expert and the source rank (rows past the
count are 0 and -1). Without ``topk_weights`` it returns main's 5-tuple. The weights come from one
all-gather of every rank's (topk_idx, topk_weights) over the group.
"""

import numpy as np
import torch

from .buffers import legacy


class Buffer(legacy.Buffer):
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights=None,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             x_global_scale=None, use_fp8=True, round_scale=False, use_ue8m0=False, use_nvfp4=False,
                             use_ue8m0_for_sf=False, async_finish=False, return_recv_hook=False):
        if use_nvfp4:
            raise NotImplementedError("use_nvfp4=True: NVFP4 low-latency dispatch is not implemented yet in moe-ep")
        if use_ue8m0_for_sf:
            raise NotImplementedError("use_ue8m0_for_sf=True applies to NVFP4 only, which moe-ep does not implement yet")
        out = self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                         cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                         round_scale, use_ue8m0, async_finish, return_recv_hook)
        if topk_weights is None:
            return out
        recv_x, count, handle, event, hook = out
        weights, rank_info = self._received_weights(topk_idx, topk_weights, handle, num_experts)
        return recv_x, count, weights, rank_info, handle, event, hook

    def _received_weights(self, topk_idx, topk_weights, handle, num_experts):
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
            raise TypeError("topk_weights must be a float32 torch tensor [num_tokens, num_topk]")
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights has shape {list(topk_weights.shape)}; expected that of topk_idx, "
                             f"{list(topk_idx.shape)}")
        idx = topk_idx.contiguous().numpy().astype(np.int64)
        w = topk_weights.contiguous().numpy().astype(np.float32)
        header = np.array(idx.shape, dtype=np.int64).tobytes()
        blocks = self._group.all_gather_bytes(header + idx.tobytes() + w.tobytes())
        src_info, layout_range = handle[0], handle[1]
        local = num_experts // self.group_size
        slots = src_info.shape[1]
        weights = torch.zeros(local, slots, dtype=torch.float32)
        ranks = torch.full((local, slots), -1, dtype=torch.int32)
        per_rank = []
        for b in blocks:
            t, k = np.frombuffer(b[:16], dtype=np.int64)
            body = b[16:]
            per_rank.append((np.frombuffer(body[:t * k * 8], dtype=np.int64).reshape(t, k),
                             np.frombuffer(body[t * k * 8:], dtype=np.float32).reshape(t, k)))
        ranges = layout_range.numpy()
        info = src_info.numpy()
        for le in range(local):
            expert = self.rank * local + le
            for s in range(self.group_size):
                begin, n = int(ranges[le, s]) >> 32, int(ranges[le, s]) & 0xffffffff
                if n == 0:
                    continue
                tokens = info[le, begin:begin + n]
                src_idx, src_w = per_rank[s]
                lanes = (src_idx[tokens] == expert)
                weights[le, begin:begin + n] = torch.from_numpy((src_w[tokens] * lanes).sum(axis=1).astype(np.float32))
                ranks[le, begin:begin + n] = s
        return weights, ranks

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None,
                            overlap=False, src_signals=None, src_signal_expect_value=0):
        if overlap or src_signals is not None:
            raise NotImplementedError("overlap / src_signals (hybrid-ep's signalled combine) are not supported by moe-ep")
        return super().low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                           return_recv_hook, out, combine_wait_recv_cost_stats)
