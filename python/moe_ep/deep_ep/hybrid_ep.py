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
    """DeepEP's V1 ``Buffer`` with the low-latency signatures of the ``hybrid-ep`` branch; the
    constructor and every other method are ``moe_ep.deep_ep.Buffer``'s."""

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights=None,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             x_global_scale=None, use_fp8=True, round_scale=False, use_ue8m0=False, use_nvfp4=False,
                             use_ue8m0_for_sf=False, async_finish=False, return_recv_hook=False):
        """Collective: main's ``low_latency_dispatch``, with the weights travelling with the rows and
        NVFP4 (docs/quantized-formats.md).

        Arguments:
            x: `torch.Tensor` ``[num_tokens, hidden]`` bfloat16, ``num_tokens <= N``.
            topk_idx: `torch.Tensor` ``[num_tokens, num_topk]`` int64, -1 for none.
            num_max_dispatch_tokens_per_rank: int, ``N``.
            num_experts: int, the experts.
            topk_weights: `torch.Tensor` ``[num_tokens, num_topk]`` float32, or None (then the
                5-tuple of main).
            cumulative_local_expert_recv_stats: `torch.Tensor` ``[num_local_experts]`` int32, or None.
            dispatch_wait_recv_cost_stats: `torch.Tensor` ``[num_ranks]`` int64, or None.
            x_global_scale: `torch.Tensor` float32 0-d, NVFP4's global scale (positive, finite), or None.
            use_fp8: bool, default True: FP8 with per-128 scales (False with ``use_nvfp4``).
            round_scale: bool, default False: FP8 scales rounded up to powers of two.
            use_ue8m0: bool, default False: FP8 scales as packed UE8M0 (needs ``round_scale``).
            use_nvfp4: bool, default False: E2M1 values with per-16 block scales.
            use_ue8m0_for_sf: bool, default False: NVFP4 scales as UE8M0 (``x_global_scale`` unused).
            async_finish: bool, default False: return at once with the call's event.
            return_recv_hook: bool, default False: receive when the returned hook is called.

        Returns:
            recv_x: the slab as main returns it, or with ``use_nvfp4`` the pair (values
                ``[num_ranks * N, hidden / 2, num_local_experts]`` uint8, scales
                ``[32, 4, rm, 4, rk, num_local_experts]``) in DeepEP's permuted views.
            recv_count: `torch.Tensor` ``[num_local_experts]`` int32.
            recv_topk_weights: `torch.Tensor` ``[num_local_experts, num_ranks * N]`` float32, each row's
                weight for that expert, 0 past the count (only with ``topk_weights``).
            recv_rank_info: `torch.Tensor` ``[num_local_experts, num_ranks * N]`` int32, each row's source
                rank, -1 past the count (only with ``topk_weights``).
            handle: the low-latency handle tuple.
            event: an ``EventOverlap`` (wrapping None unless ``async_finish``).
            hook: a callable completing the receive with ``return_recv_hook``, else None.
        """
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
        """Collective: main's ``low_latency_combine``, with the signalled form of single-batch
        overlap (docs/legacy.md §4).

        Arguments:
            x: `torch.Tensor` bfloat16 ``[num_local_experts, num_ranks * N, hidden]``.
            topk_idx: `torch.Tensor` ``[num_tokens, num_topk]`` int64, the dispatched ids.
            topk_weights: `torch.Tensor` ``[num_tokens, num_topk]`` float32.
            handle: the handle tuple of the low-latency dispatch.
            use_logfmt: bool, default False: LogFMT-10 compression (not with ``zero_copy``).
            zero_copy: bool, default False: the outputs are already in the next combine buffer.
            async_finish: bool, default False: return at once with the call's event.
            return_recv_hook: bool, default False: reduce when the returned hook is called.
            out: `torch.Tensor` ``[num_tokens, hidden]`` bfloat16 to write into, or None.
            combine_wait_recv_cost_stats: `torch.Tensor` ``[num_ranks]`` int64, or None.
            overlap: bool, default False: the signalled combine (requires ``src_signals``).
            src_signals: `torch.Tensor` ``[num_local_experts]`` int32 or uint32, or None: the rows are
                handed over once ``src_signals[e] >= src_signal_expect_value`` for every local expert.
            src_signal_expect_value: int, default 0, in ``[0, 2**32 - 1]``.

        Returns:
            combined_x: `torch.Tensor` bfloat16 ``[num_tokens, hidden]``.
            event: an ``EventOverlap`` (wrapping None unless ``async_finish``).
            hook: a callable completing the combine with ``return_recv_hook``, else None.
        """
        # uint32 signals (what DeepGEMM raises) as the same words typed int32: the extension reads
        # them unsigned; any other object reaches it unchanged and is refused there, on every rank.
        if isinstance(src_signals, torch.Tensor) and src_signals.dtype == torch.uint32:
            src_signals = src_signals.view(torch.int32)
        return self._low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                         return_recv_hook, out, combine_wait_recv_cost_stats, overlap, src_signals,
                                         src_signal_expect_value)
