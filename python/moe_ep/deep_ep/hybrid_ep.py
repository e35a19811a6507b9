"""``Buffer`` with the low-latency signatures of DeepEP's ``hybrid-ep`` branch (the ones SGLang and
vLLM call when they pass ``topk_weights`` or NVFP4 arguments).

``low_latency_dispatch(..., topk_weights=...)`` returns the 7-tuple ``(recv_x, recv_count,
recv_topk_weights [L, R*N] float32, recv_rank_info [L, R*N] int32, handle, event, hook)``: for each
received row, the weight its source token gave this expert and the source rank (rows past the
count are 0 and -1); the weights travel with the rows. Without ``topk_weights`` it returns main's
5-tuple. ``use_nvfp4=True`` (with ``use_fp8=False`` and a float32 scalar ``x_global_scale``, or
``use_ue8m0_for_sf=True``) sends E2M1 values with per-16 block scales; ``recv_x`` is then the pair
``(values [R*N, H/2, L] uint8, scales [32, 4, rm, 4, rk, L])`` in DeepEP's permuted views
(docs/quantized-formats.md).

``low_latency_combine(..., overlap=False, src_signals=None, src_signal_expect_value=0)`` is the
signalled combine: with ``src_signals`` (int32 or uint32 ``[El]``), the rows of local expert ``e``
are handed to the ranks that read them once ``src_signals[e] >= src_signal_expect_value``, as
another thread producing ``x`` raises them (docs/legacy.md §4).
"""

import torch

from .buffers import legacy


class Buffer(legacy.Buffer):
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights=None,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             x_global_scale=None, use_fp8=True, round_scale=False, use_ue8m0=False, use_nvfp4=False,
                             use_ue8m0_for_sf=False, async_finish=False, return_recv_hook=False):
        out = self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                         cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                         round_scale, use_ue8m0, async_finish, return_recv_hook, topk_weights,
                                         x_global_scale, use_nvfp4, use_ue8m0_for_sf)
        if topk_weights is None:
            return out
        recv_x, count, handle, event, hook, weights, rank_info = out
        return recv_x, count, weights, rank_info, handle, event, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None,
                            overlap=False, src_signals=None, src_signal_expect_value=0):
        # uint32 signals (what DeepGEMM raises) as the same words typed int32: the extension reads
        # them unsigned; any other object reaches it unchanged and is refused there, on every rank.
        if isinstance(src_signals, torch.Tensor) and src_signals.dtype == torch.uint32:
            src_signals = src_signals.view(torch.int32)
        return self._low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                         return_recv_hook, out, combine_wait_recv_cost_stats, overlap, src_signals,
                                         src_signal_expect_value)
