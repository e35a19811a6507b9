"""``ElasticBuffer`` and ``EPHandle``: DeepEP's V2 buffer on moe-ep's C++ ElasticBuffer.

Signatures, defaults and return tuples are DeepEP's (2.1.0). The receive order is always
deterministic (by source rank, then source token), so ``deterministic`` changes nothing and
``EPHandle.deterministic_sort`` returns its inputs. GPU-only arguments (``sl_idx``, ``num_sms`` and
``num_qps`` as SM/QP counts, ``use_tma_aligned_col_major_sf`` as a layout, streams) are accepted:
``num_sms`` sets worker threads, ``num_qps`` the scale-out transfers in flight.

On CUDA tensors the buffer is backed by the CUDA provider when one is usable (``_provider``;
``ElasticBuffer.provider`` says which): each call runs after the work queued on torch's current
stream, and a synchronous call makes that stream wait for it and waits for it on the host, so that a
failure raises in the call (docs/python.md, "CUDA tensors").
"""

import torch

from ... import _C
from ..._arguments import Conversions, int32
from ..utils import EventHandle, _native, _overlap
from . import _provider
from ._agrs import AgrsMixin
from ._common import bias_list, group_of, or_default
from ._engram_pp import EngramPPMixin

# DeepEP's defaults of get_theoretical_num_sms are GPU SM bandwidths; left at them, moe-ep uses the
# bandwidths it measured on this machine.
_DEFAULT_SM_READ_GBS = 200
_DEFAULT_SM_WRITE_GBS = 50
MAX_WORKERS = 1024  # moe_ep/limits.hpp kMaxWorkers: num_sms of dispatch and combine is at most this


class EPHandle:
    """The routing state of a non-cached dispatch (DeepEP's fields), returned by
    ``ElasticBuffer.dispatch`` and passed back to a cached dispatch or to ``combine`` unchanged.

    Fields (read on first use): ``do_expand``, ``num_experts``, ``expert_alignment``,
    ``num_max_tokens_per_rank``, ``num_sms``, ``num_recv_tokens``, ``num_expanded_tokens``,
    ``num_recv_tokens_per_expert_list`` (aligned counts, empty without CPU sync), ``topk_idx``,
    ``psum_num_recv_tokens_per_scaleup_rank`` int32 ``[num_scaleup_ranks]``,
    ``psum_num_recv_tokens_per_expert`` / ``num_unaligned_recv_tokens_per_expert`` int32
    ``[num_local_experts]``, ``recv_src_metadata`` int32 ``[num_recv_tokens, num_topk + 2]``,
    ``dst_buffer_slot_idx`` int32 ``[num_tokens, num_topk]`` (docs/semantics.md, "Handle"). The
    GPU-only ``token_metadata_at_forward``, ``channel_linked_list`` and
    ``cached_recv_src_metadata_before_sort`` are None.

    Arguments:
        native: the extension's handle (``moe_ep._C.EPHandle``) behind it.
        event: the event of an asynchronous dispatch, waited for before a field is read; None for a
            synchronous one.
    """

    _TENSORS = ("topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx")
    _VALUES = ("do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms",
               "num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list")

    def __init__(self, native, event=None):
        self._native = native
        self._event = event  # an asynchronous dispatch fills the handle on the communication worker
        # Hybrid-kernel bookkeeping of DeepEP's GPU data path; moe-ep's has no counterpart.
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.cached_recv_src_metadata_before_sort = None

    def __getattr__(self, name):
        # Fields are read from the native handle on first use (tensors are exported once).
        if name in EPHandle._TENSORS or name in EPHandle._VALUES:
            event = self.__dict__.get("_event")
            if event is not None and not event.query():
                event.wait()
            value = getattr(self._native, name)
            setattr(self, name, value)
            return value
        raise AttributeError(f"'EPHandle' object has no attribute '{name}'")

    def deterministic_sort(self, do_cpu_sync, is_cached, recv_x, recv_sf, recv_topk_idx, recv_topk_weights,
                           channel_linked_list=None):
        """DeepEP's sort of received rows into ascending source order; moe-ep receives them in that
        order already, so it returns its inputs unchanged.

        Arguments:
            do_cpu_sync: bool, whether the dispatch synchronised with the host (unused).
            is_cached: bool, whether the dispatch was cached (unused).
            recv_x: `torch.Tensor` ``[num_recv_tokens, hidden]``, the received rows.
            recv_sf: `torch.Tensor` ``[num_recv_tokens, P]`` of the received FP8 scales, or None.
            recv_topk_idx: `torch.Tensor` ``[num_recv_tokens, num_topk]`` int64, or None.
            recv_topk_weights: `torch.Tensor` of the received weights (float32), or None.
            channel_linked_list: DeepEP's hybrid-kernel list, default None (unused).

        Returns:
            recv_x, recv_sf, recv_topk_idx, recv_topk_weights, channel_linked_list: the inputs, as given.
        """
        # The rows are already in ascending source order.
        return recv_x, recv_sf, recv_topk_idx, recv_topk_weights, channel_linked_list


class ElasticBuffer(EngramPPMixin, AgrsMixin):
    """DeepEP V2's expert-parallel buffer: dispatch and combine for one group, sized from the MoE
    shape. Construction, ``dispatch``, ``combine`` and the calls whose docstring says "Collective"
    are collective: every rank of the group makes them in the same order; the others are local.

    Arguments:
        group: a ``torch.distributed.ProcessGroup`` (processes of one host), an mpi4py
            communicator or a ``moe_ep.Group``.
        num_bytes: int, the bytes of the dispatch pool, a positive multiple of 2 MiB; None (the
            default) or 0 sizes it from the shape below (``get_buffer_size_hint``). With
            ``num_cpu_bytes > 0`` it is required and is the total.
        num_cpu_bytes: int, default 0: the Engram storage of this rank (a multiple of 2 MiB, at
            most ``num_bytes``; docs/engram-pp.md).
        num_max_tokens_per_rank: int, default 0: the most tokens a rank dispatches in one call
            (``T``; the default of ``dispatch``), the same on every rank.
        hidden: int, default 0: the hidden size of every call when not 0.
        num_topk: int, default 0: the top-k the buffer is sized for (0: the largest, 32).
        use_fp8_dispatch: bool, default False: size for FP8 payloads with scales.
        deterministic: bool, default False; accepted, changes nothing (the receive order is always
            by source rank, then source token).
        allow_hybrid_mode: bool, default True: across nodes, send each token once per node and
            forward it within the node; False sends it to every destination rank directly.
        allow_multiple_reduction: bool, default True: reduce a rank's expanded rows, and in hybrid
            mode a node's rows, before sending them back (docs/semantics.md §4).
        prefer_overlap_with_compute: bool, default True: DeepEP's SM model leaves SMs to compute
            (``get_theoretical_num_sms``).
        sl_idx: int, default 3: DeepEP's RDMA service level; no effect.
        num_allocated_qps: int, default 0: scale-out transfers in flight per peer, the most a call's
            ``num_qps`` may ask (0: 129 with hybrid mode allowed, 17 without).
        num_cpu_timeout_secs: number, default 300: how long a rank waits for its peers before
            ``moe_ep.TimeoutError``.
        num_gpu_timeout_secs: number, default 100: DeepEP's device timeout; no effect on CPU.
        explicitly_destroy: bool, default False: the buffer is freed by ``destroy()``, which must
            then be called.
    """
    def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, num_topk=0,
                 use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0, num_cpu_timeout_secs=300,
                 num_gpu_timeout_secs=100, explicitly_destroy=False):
        self.group = group
        self._group = group_of(group, None)
        self.rank_idx = self._group.rank()
        self.num_ranks = self._group.size()
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        choice = _provider.choose(self._group)
        # Collective: a rank whose sizes are not integers it can take is refused in the
        # construction's agreement (its own error here, PeerError naming it on the others).
        sizes = Conversions()
        num_bytes = sizes.int64(0 if num_bytes is None else num_bytes, "num_bytes")
        num_cpu_bytes = sizes.int64(num_cpu_bytes, "num_cpu_bytes")
        shape = [sizes.int32(value, name) for value, name in ((num_max_tokens_per_rank, "num_max_tokens_per_rank"),
                                                              (hidden, "hidden"), (num_topk, "num_topk"))]
        num_allocated_qps = sizes.int32(num_allocated_qps, "num_allocated_qps")
        refusal = choice.refusal or (f"[rank {self.rank_idx}] ElasticBuffer: {sizes.rejection}" if sizes.error else "")
        try:
            self.runtime = _C.ElasticBuffer(self._group, num_bytes, *shape, use_fp8_dispatch, deterministic,
                                            allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute,
                                            num_allocated_qps, num_cpu_timeout_secs, explicitly_destroy, choice.cuda,
                                            choice.device, choice.why_host, refusal, choice.provider_path,
                                            num_cpu_bytes=num_cpu_bytes)
        except _C.Error:
            if sizes.error is not None:
                raise sizes.error from None
            raise
        rt = self.runtime
        self._provider, self._device = rt.provider, rt.device
        self.num_bytes = rt.num_bytes
        self.num_max_tokens_per_rank = rt.num_max_tokens_per_rank
        self.num_allocated_qps = rt.num_allocated_qps
        self.num_scaleout_ranks, self.num_scaleup_ranks = rt.num_scaleout_ranks, rt.num_scaleup_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = rt.scaleout_rank_idx, rt.scaleup_rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = rt.get_physical_domain_size()

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=0, use_fp8_dispatch=False,
                             allow_hybrid_mode=True, allow_multiple_reduction=True):
        """The bytes of pool a buffer of this shape needs (what ``num_bytes=None`` gives); local.

        Arguments:
            group: the group the buffer will be built on (its topology decides the paths).
            num_max_tokens_per_rank: int, the most tokens a rank dispatches in one call.
            hidden: int, the hidden size.
            num_topk: int, default 0: the top-k (0: the largest, 32).
            use_fp8_dispatch: bool, default False: FP8 payloads with scales.
            allow_hybrid_mode: bool, default True, as the constructor's.
            allow_multiple_reduction: bool, default True, as the constructor's.

        Returns:
            num_bytes: int, a multiple of 2 MiB (docs/sizing.md).
        """
        return _C.ElasticBuffer.get_buffer_size_hint(
            group_of(group, None), int32(num_max_tokens_per_rank, "num_max_tokens_per_rank"), int32(hidden, "hidden"),
            int32(num_topk, "num_topk"), use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)

    @property
    def provider(self):
        """The provider behind this buffer: "cuda" (CUDA tensors on ``device``) or "cpu" (host tensors)."""
        return self._provider

    @property
    def device(self):
        """The ``torch.device`` the buffer's tensors live on: ``cuda:N`` or ``cpu``."""
        return torch.device("cuda", self._device) if self._provider == "cuda" else torch.device("cpu")

    def _stream(self):
        return _provider.current_stream(self._device) if self._provider == "cuda" else 0

    @staticmethod
    def capture():
        """An event of the work launched so far, for ``previous_event``.

        Returns:
            event: an ``EventHandle``, already complete (on CPU work runs in call order).
        """
        return EventHandle()

    def get_comm_stream(self):
        """The stream communication is ordered on: with the CUDA provider the caller's current stream
        (each call runs on it), on CPU torch's CPU stream (calls run in call order on the host).

        Returns:
            stream: a ``torch.cuda.Stream`` or ``torch.cpu.Stream``.
        """
        if self._provider == "cuda":
            return torch.cuda.current_stream(self._device)
        return torch.cpu.current_stream()

    def _rt(self):
        if self.runtime is None:
            raise _C.StateError(f"[rank {self.rank_idx}] the buffer was destroyed")
        return self.runtime

    def destroy(self):
        """Collective: frees the buffer; allowed only with ``explicitly_destroy=True``
        (``AssertionError`` otherwise). Later calls raise ``moe_ep.StateError``."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._rt().destroy()
        self.runtime = None

    def get_physical_domain_size(self):
        """The group's physical domains.

        Returns:
            num_rdma_ranks: int, the nodes.
            num_nvl_ranks: int, the ranks of each node.
        """
        return self._rt().get_physical_domain_size()

    def get_logical_domain_size(self):
        """The domains dispatch and combine work in: the physical ones with ``allow_hybrid_mode``,
        else one node of every rank.

        Returns:
            num_scaleout_ranks: int, the logical nodes.
            num_scaleup_ranks: int, the ranks of each.
        """
        return self._rt().get_logical_domain_size()

    def get_theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, nvlink_gbs=0,
                                sm_read_gbs=200, sm_write_gbs=50):
        """Worker threads per rank from DeepEP's bandwidth model for a uniform gate, fed with the
        bandwidths moe-ep measured on this machine and capped by the cores of each rank
        (docs/semantics.md §6); 0 on the CUDA provider, which sizes its launches itself.

        Arguments:
            num_experts: int, the experts of the calls.
            num_topk: int, their top-k.
            num_scaleout_topk: int, default 0 (DeepEP asserts 0).
            rdma_gbs: number, default 0: the scale-out bandwidth in GB/s (0: measured).
            nvlink_gbs: number, default 0: the scale-up bandwidth in GB/s (0: measured).
            sm_read_gbs: number, default 200: read bandwidth of one worker; DeepEP's GPU default
                means the measured one.
            sm_write_gbs: number, default 50: write bandwidth of one worker; DeepEP's GPU default
                means the measured one.

        Returns:
            num_sms: int, what ``num_sms=0`` of ``dispatch`` uses.
        """
        read = 0 if sm_read_gbs == _DEFAULT_SM_READ_GBS else sm_read_gbs
        write = 0 if sm_write_gbs == _DEFAULT_SM_WRITE_GBS else sm_write_gbs
        return self._rt().get_theoretical_num_sms(int32(num_experts, "num_experts"), int32(num_topk, "num_topk"),
                                                  int32(num_scaleout_topk, "num_scaleout_topk"), rdma_gbs, nvlink_gbs,
                                                  read, write)

    def get_theoretical_num_qps(self, num_sms):
        """The scale-out transfers in flight for a call of ``num_sms`` workers: ``num_sms * 16 + 1``
        with hybrid mode allowed, else ``min(num_sms, 9)``, at most ``num_allocated_qps``.

        Arguments:
            num_sms: int in ``[0, 1024]``.

        Returns:
            num_qps: int (0 on the CUDA provider).
        """
        return self._rt().get_theoretical_num_qps(int32(num_sms, "num_sms", 0, MAX_WORKERS))

    # Long: the docstring of DeepEP's twenty arguments and five results (the body is twelve lines).
    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
                 num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None,
                 previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False,
                 handle=None, do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False):
        """Collective: sends every token once to each rank that owns one of its top-k experts;
        rows arrive by source rank, then source token (docs/semantics.md §3).

        Arguments:
            x: `torch.Tensor` ``[num_tokens, hidden]`` of a 1-, 2- or 4-byte dtype (bfloat16 in
                normal use; rows of a multiple of 16 bytes), or the FP8 pair ``(x_fp8, x_scales)``:
                float8_e4m3fn ``[num_tokens, hidden]`` and float32 or int32 ``[num_tokens, P]``
                scales, moved as they are. ``num_tokens <= num_max_tokens_per_rank``.
            topk_idx: `torch.Tensor` ``[num_tokens, num_topk]`` int64 (``topk_idx_t``), expert ids in
                ``[-1, num_experts)``, -1 for none, an expert at most once per row; None with
                ``handle``.
            topk_weights: `torch.Tensor` ``[num_tokens, num_topk]`` float32, or None; moved with the
                rows (also with a handle).
            cumulative_local_expert_recv_stats: `torch.Tensor` ``[num_local_experts]`` int32, or None:
                the rows each local expert receives are added to it; not with a handle.
            num_experts: int, the experts (a multiple of the ranks); required without ``handle``.
            num_max_tokens_per_rank: int or None: the constructor's (with a handle, the handle's).
            expert_alignment: int or None (1; with a handle, the handle's): each local expert's
                count is rounded up to it in ``num_recv_tokens_per_expert_list`` and the expanded layout.
            num_sms: int, default 0: worker threads (0: ``get_theoretical_num_sms`` of the call's
                experts and top-k).
            num_qps: int, default 0: scale-out transfers in flight (0: ``num_allocated_qps``).
            previous_event: an ``EventHandle`` / ``EventOverlap`` the call waits for first, or None;
                requires ``allocate_on_comm_stream=True``.
            previous_event_before_epilogue: an event waited for after the counts are exchanged,
                before rows move, or None.
            async_with_compute_stream: bool, default False: return at once with an event that
                completes when the rank's communication worker finished the call.
            allocate_on_comm_stream: bool, default False: accepted (outputs are allocated by whoever
                runs the call).
            handle: an ``EPHandle`` of an earlier dispatch (cached dispatch: its routing, counts and
                layout are reused), or None.
            do_handle_copy: bool, default True: the handle keeps a copy of ``topk_idx`` (False: the
                caller's tensor, which must stay alive and unchanged).
            do_cpu_sync: bool or None (True; False with a handle): False returns worst-case shapes
                without waiting for the counts.
            do_expand: bool, default False: one row per (token, local expert) grouped by local
                expert, each expert's block aligned to ``expert_alignment``.
            do_zero_padding: bool, default False: zero the padding rows of the expanded layout.
            use_tma_aligned_col_major_sf: bool, default False: ``recv_x``'s scales column-major,
                strides ``(1, a(M, 4))``.

        Returns:
            recv_x: `torch.Tensor` ``[M, hidden]`` of ``x``'s dtype (``M`` rows received, or
                ``M_exp`` expanded; the worst case without CPU sync), or the pair
                ``(recv_x, recv_x_scales [M, P])`` for an FP8 ``x``.
            recv_topk_idx: `torch.Tensor` ``[M, num_topk]`` int64: the local expert of each lane, -1
                where it lives elsewhere; None when expanded.
            recv_topk_weights: `torch.Tensor` float32, ``[M, num_topk]`` (the whole weight row) or
                ``[M_exp]`` expanded; None without ``topk_weights``.
            handle: the new ``EPHandle``, or the given one.
            event: an ``EventOverlap``: the call's event with ``async_with_compute_stream``, else
                wrapping None.
        """
        native = handle._native if isinstance(handle, EPHandle) else handle
        recv_x, recv_sf, recv_idx, recv_w, new_native, ev = self._rt().dispatch(
            x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, or_default(num_experts, 0),
            or_default(num_max_tokens_per_rank, 0), or_default(expert_alignment, 0), num_sms, num_qps,
            _native(previous_event, "previous_event"),
            _native(previous_event_before_epilogue, "previous_event_before_epilogue"), async_with_compute_stream,
            allocate_on_comm_stream, native, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
            use_tma_aligned_col_major_sf, self._stream())
        if isinstance(x, tuple):
            recv_x = (recv_x, recv_sf)
        out_handle = handle if handle is not None else EPHandle(new_native, ev)
        return recv_x, recv_idx, recv_w, out_handle, _overlap(ev, async_with_compute_stream)

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False):
        """Collective: returns to every token the sum of the rows its destination ranks produced,
        in FP32 in a fixed order, rounded once to bfloat16; weights are not applied (docs/semantics.md §4).

        Arguments:
            x: `torch.Tensor` bfloat16 ``[handle.num_recv_tokens, hidden]`` (compact) or
                ``[handle.num_expanded_tokens, hidden]`` (expanded), in the dispatch's row order.
            handle: the ``EPHandle`` of the dispatch.
            topk_weights: `torch.Tensor` float32 ``[M, num_topk]`` (compact) or ``[M_exp]``
                (expanded) sent back with the rows, or None.
            bias: None, one bfloat16 `torch.Tensor` ``[num_tokens, hidden]``, or a pair of them,
                added to each token's sum.
            num_sms: int, default 0: worker threads (0: the handle's).
            num_qps: int, default 0: scale-out transfers in flight (0: ``num_allocated_qps``).
            previous_event: an event the call waits for first, or None.
            previous_event_before_epilogue: an event waited for after the agreement, before rows
                move, or None.
            async_with_compute_stream: bool, default False: return at once with the call's event.
            allocate_on_comm_stream: bool, default False: accepted (no streams on CPU).

        Returns:
            combined_x: `torch.Tensor` bfloat16 ``[num_tokens, hidden]``.
            combined_topk_weights: `torch.Tensor` float32 ``[num_tokens, num_topk]``: the weight each
                lane's rank sent back, 0 where ``topk_idx`` is -1; None without ``topk_weights``.
            event: an ``EventOverlap`` (wrapping None unless ``async_with_compute_stream``).
        """
        native = handle._native if isinstance(handle, EPHandle) else handle
        combined, combined_w, ev = self._rt().combine(
            x, native, topk_weights, bias_list(bias), num_sms, num_qps,
            _native(previous_event, "previous_event"),
            _native(previous_event_before_epilogue, "previous_event_before_epilogue"), async_with_compute_stream,
            allocate_on_comm_stream, self._stream())
        return combined, combined_w, _overlap(ev, async_with_compute_stream)
