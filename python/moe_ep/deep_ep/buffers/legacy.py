"""``Buffer``: DeepEP's V1 ("legacy") buffer on moe-ep's C++ Buffer.

Signatures, defaults and return tuples are DeepEP's (main, 2.1.0). GPU-only arguments
(``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``allocate_on_comm_stream``,
``Config`` chunk sizes) are accepted. ``enable_shrink=True`` keeps a per-rank mask of peers that the
low-latency calls leave out (docs/legacy.md §4).
"""

import torch

from ... import _C
from ..._arguments import Conversions, int32, int64
from ..utils import EventHandle, EventOverlap, _native, _overlap
from ._common import DeferredHandleTuple, HandleTuple, bias_list, group_of, native_handle

Config = _C.Config


class Buffer:
    """DeepEP V1's buffer: normal-mode dispatch and combine (with ``get_dispatch_layout``) and the
    low-latency mode (docs/legacy.md). Construction and the calls whose docstring says "Collective"
    are collective: every rank of the group makes them in the same order; the others are local.

    Arguments:
        group: a ``torch.distributed.ProcessGroup`` (processes of one host) or a ``moe_ep.Group``;
            give ``group`` or ``comm``, not both.
        num_nvl_bytes: int, default 0: the scale-up buffer (a multiple of 128; moe-ep reads node
            peers' tensors in place and keeps it only for ``get_local_buffer_tensor``).
        num_rdma_bytes: int, default 0: the scale-out pool (a multiple of 128): rows that cross
            nodes in normal mode, and the two low-latency slots (``get_low_latency_rdma_size_hint``).
        low_latency_mode: bool, default False: enables ``low_latency_dispatch`` / ``_combine``.
        num_qps_per_rank: int, default 24: scale-out transfers in flight per peer.
        allow_nvlink_for_low_latency_mode: bool, default True; no effect.
        allow_mnnvl: bool, default False; no effect.
        explicitly_destroy: bool, default False: the buffer is freed by ``destroy()``, which must
            then be called.
        enable_shrink: bool, default False: low-latency calls go on without failed or masked ranks
            (docs/legacy.md §4).
        comm: an mpi4py communicator (the MPI transport), in place of ``group``; default None.

    The timeout of the calls is ``MOE_EP_TIMEOUT_SECS``. ``Buffer.num_sms`` (20) is the SM count of
    the default configs (``set_num_sms``).
    """

    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False,
                 enable_shrink=False, comm=None):
        self.group = group if group is not None else comm
        self._group = group_of(group, comm)
        self.rank = self._group.rank()
        self.group_size = self._group.size()
        # Collective: every rank learns whether some rank's sizes are not integers it can take.
        sizes = Conversions()
        num_nvl_bytes = sizes.int64(num_nvl_bytes, "num_nvl_bytes")
        num_rdma_bytes = sizes.int64(num_rdma_bytes, "num_rdma_bytes")
        num_qps_per_rank = sizes.int32(num_qps_per_rank, "num_qps_per_rank")
        sizes.agree(self._group, f"[rank {self.rank}] Buffer")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.runtime = _C.Buffer(self._group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                                 allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy,
                                 bool(enable_shrink), _C.timeout_from_env())

    # ---- lifecycle and static helpers -------------------------------------------------------
    def destroy(self):
        """Collective (shrink mode: waits for the other ranks to leave): frees the buffer; allowed
        only with ``explicitly_destroy=True``. Later calls raise ``moe_ep.StateError``."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._rt().destroy()
        self.runtime = None

    @staticmethod
    def is_sm90_compiled():
        """Whether DeepEP's SM90 kernels were built: never, on CPU.

        Returns:
            compiled: bool, False.
        """
        return False

    @staticmethod
    def set_num_sms(new_num_sms):
        """Sets ``Buffer.num_sms``, the SM count of the default configs, for the whole process.

        Arguments:
            new_num_sms: int, even (``AssertionError`` otherwise), in ``[2, 1024]``.
        """
        new_num_sms = int32(new_num_sms, "new_num_sms")
        assert new_num_sms % 2 == 0, "The SM count must be even"
        _C.Buffer.set_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        """An event of the work launched so far, for ``previous_event``.

        Returns:
            event: an ``EventOverlap`` of an ``EventHandle``, already complete.
        """
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """DeepEP's ``num_rdma_bytes`` for low-latency mode (moe-ep's own need where larger); local.

        Arguments:
            num_max_dispatch_tokens_per_rank: int, ``N``, the most tokens of a low-latency call.
            hidden: int, the hidden size, a multiple of 128.
            num_ranks: int, the ranks of the group.
            num_experts: int, the experts.

        Returns:
            num_bytes: int, a multiple of 128.
        """
        return _C.Buffer.get_low_latency_rdma_size_hint(
            int32(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank"), int32(hidden, "hidden"),
            int32(num_ranks, "num_ranks"), int32(num_experts, "num_experts"))

    @staticmethod
    def get_dispatch_config(num_ranks):
        """DeepEP's default dispatch config for a rank count (a count outside its table: the next
        larger entry), with ``Buffer.num_sms``.

        Arguments:
            num_ranks: int, the ranks of the group.

        Returns:
            config: a ``Config``.
        """
        return _C.Buffer.get_dispatch_config(int32(num_ranks, "num_ranks"))

    @staticmethod
    def get_combine_config(num_ranks):
        """DeepEP's default combine config for a rank count, as ``get_dispatch_config``.

        Arguments:
            num_ranks: int, the ranks of the group.

        Returns:
            config: a ``Config``.
        """
        return _C.Buffer.get_combine_config(int32(num_ranks, "num_ranks"))

    def get_comm_stream(self):
        """The stream communication is ordered on: on CPU every call runs in call order on the host,
        so it is torch's CPU stream.

        Returns:
            stream: ``torch.cpu.current_stream()``.
        """
        return torch.cpu.current_stream()

    # ---- shrink mode (enable_shrink=True; docs/legacy.md §4) ---------------------------------
    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (or unmasks) a peer for this rank's low-latency calls (shrink mode); local.

        Arguments:
            rank_to_mask: int in ``[0, num_ranks)``.
            mask: bool, default False: True masks the rank, False unmasks it.
        """
        self._rt().low_latency_update_mask_buffer(int32(rank_to_mask, "rank_to_mask"), mask)

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes this rank's mask (shrink mode) into a tensor; local.

        Arguments:
            mask_status: `torch.Tensor` ``[num_ranks]`` int32, set to 1 where the rank is masked, else 0.
        """
        self._rt().low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank (shrink mode); local."""
        self._rt().low_latency_clean_mask_buffer()

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """A raw view of this rank's own buffer from byte ``offset`` on: the scale-up buffer
        (``num_nvl_bytes``, host memory used by nothing else) or, with ``use_rdma_buffer``, the
        scale-out pool (``num_rdma_bytes``, where the low-latency slots live); 1-D of ``dtype``, or
        its first ``size.numel()`` elements shaped ``size``. It keeps the memory alive.

        Arguments:
            dtype: the ``torch.dtype`` of the view.
            size: a shape (``torch.Size`` or a tuple of ints), or None (default): the whole rest.
            offset: int, default 0: the first byte, a multiple of ``dtype``'s size.
            use_rdma_buffer: bool, default False: the scale-out pool instead of the scale-up buffer.

        Returns:
            tensor: a `torch.Tensor` view of ``dtype``, 1-D or shaped ``size``.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
        offset = int64(offset, "offset")
        item = dtype.itemsize
        if offset % item != 0:
            raise _C.InvalidArgument(f"[rank {self.rank}] get_local_buffer_tensor: offset = {offset} is not a multiple "
                                     f"of the {item} bytes of {dtype}")
        raw = self._rt().get_local_buffer_tensor(offset, bool(use_rdma_buffer))
        tensor = raw[:raw.numel() // item * item].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise _C.InvalidArgument(f"[rank {self.rank}] get_local_buffer_tensor: size = {tuple(size)} needs "
                                     f"{size.numel()} elements of {dtype}; the buffer holds {tensor.numel()} from "
                                     f"offset {offset}")
        return tensor[:size.numel()].view(size)

    def _rt(self):
        if self.runtime is None:
            raise _C.StateError(f"[rank {self.rank}] the buffer was destroyed")
        return self.runtime

    # ---- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """The layout a normal-mode dispatch takes, computed from the routing; local.

        Arguments:
            topk_idx: `torch.Tensor` ``[num_tokens, num_topk]`` int64 (``topk_idx_t``), expert ids in
                ``[-1, num_experts)``, -1 for none, an expert at most once per row.
            num_experts: int, the experts (a multiple of the ranks).
            previous_event: an ``EventOverlap`` the call waits for first, or None.
            async_finish: bool, default False: return at once with the call's event.
            allocate_on_comm_stream: bool, default False; True requires ``previous_event`` and
                ``async_finish``.

        Returns:
            num_tokens_per_rank: `torch.Tensor` ``[num_ranks]`` int32, tokens with an expert on each rank.
            num_tokens_per_rdma_rank: `torch.Tensor` ``[num_nodes]`` int32, or None on one node.
            num_tokens_per_expert: `torch.Tensor` ``[num_experts]`` int32, (token, lane) pairs per expert.
            is_token_in_rank: `torch.Tensor` ``[num_tokens, num_ranks]`` bool.
            event: an ``EventOverlap`` (wrapping None unless ``async_finish``).
        """
        per_rank, per_rdma, per_expert, in_rank, ev = self._rt().get_dispatch_layout(
            topk_idx, int32(num_experts, "num_experts"), _native(previous_event, "previous_event"), async_finish,
            allocate_on_comm_stream)
        return per_rank, per_rdma, per_expert, in_rank, _overlap(ev, async_finish)

    def _handle_tuple(self, native, event):
        internode = self._group.num_scaleout > 1

        def items(native):
            (rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head, recv_rdma_psum,
             recv_gbl_psum) = native.fields()
            if not internode:
                return rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head
            # DeepEP's internode handle; the fields moe-ep's data path has no counterpart for are None.
            return (in_rank, None, channel_prefix, None, recv_rdma_psum, recv_channel_prefix, recv_gbl_psum, None,
                    None, None)

        if event.query():
            return HandleTuple(items(native), native)
        return DeferredHandleTuple(native, event, items)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """Collective: sends every token once to each rank ``is_token_in_rank`` names (normal mode);
        rows arrive by source rank, then source token (docs/legacy.md §3).

        Arguments:
            x: `torch.Tensor` ``[num_tokens, hidden]`` of a 1-, 2- or 4-byte dtype (bfloat16 in normal
                use; rows of a multiple of 16 bytes), the FP8 pair ``(x_fp8, x_scales)``
                (float8_e4m3fn ``[num_tokens, hidden]``, float32 or int32 ``[num_tokens, P]``), or on
                one node the NVFP4 triple (int32 ``[num_tokens, hidden / 8]``, int32
                ``[num_tokens, hidden / 64]``, float32 ``[num_tokens, S]``).
            handle: the handle of an earlier dispatch (cached dispatch: its layout is reused and only
                ``x`` moves), or None.
            num_tokens_per_rank: `torch.Tensor` ``[num_ranks]`` int32 from ``get_dispatch_layout``.
            num_tokens_per_rdma_rank: `torch.Tensor` ``[num_nodes]`` int32, or None on one node.
            is_token_in_rank: `torch.Tensor` ``[num_tokens, num_ranks]`` bool.
            num_tokens_per_expert: `torch.Tensor` ``[num_experts]`` int32.
            topk_idx: `torch.Tensor` ``[num_tokens, num_topk]`` int64 (the layout must be the one it
                gives), or None; not with a handle.
            topk_weights: `torch.Tensor` ``[num_tokens, num_topk]`` float32, or None; not with a handle.
            expert_alignment: int, default 1: each local expert's count is rounded up to it in
                ``num_recv_tokens_per_expert_list``.
            num_worst_tokens: int, default 0: > 0 returns that many rows without waiting for the
                counts (ids -1 past the real rows).
            config: a ``Config``, or None: ``get_dispatch_config(num_ranks)``.
            previous_event: an ``EventOverlap`` the call waits for first, or None.
            async_finish: bool, default False: return at once with the call's event.
            allocate_on_comm_stream: bool, default False; True requires ``previous_event`` and
                ``async_finish``.

        Returns:
            recv_x: `torch.Tensor` ``[M, hidden]`` of ``x``'s dtype, or the FP8 pair / NVFP4 triple.
            recv_topk_idx: `torch.Tensor` ``[M, num_topk]`` int64: local expert ids, -1 elsewhere.
            recv_topk_weights: `torch.Tensor` ``[M, num_topk]`` float32, 0 where the id is -1.
            num_recv_tokens_per_expert_list: list of int, per local expert (aligned); empty with
                ``num_worst_tokens``.
            handle: DeepEP's handle tuple (6 items on one node, 10 across nodes, docs/python.md).
            event: an ``EventOverlap`` (wrapping None unless ``async_finish``).
            With ``handle`` (cached): ``(recv_x, None, None, None, None, event)``.
        """
        recv_x, recv_sf, recv_idx, recv_w, counts, new_handle, ev = self._rt().dispatch(
            x, native_handle(handle), num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
            topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
            _native(previous_event, "previous_event"), async_finish, allocate_on_comm_stream)
        if isinstance(x, tuple) and len(x) == 2:  # FP8; the NVFP4 triple comes back as a triple already
            recv_x = (recv_x, recv_sf)
        event = _overlap(ev, async_finish)
        if handle is not None:
            return recv_x, None, None, None, None, event
        return recv_x, recv_idx, recv_w, counts, self._handle_tuple(new_handle, ev), event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        """Collective: returns to every token the sum of the rows of the ranks it went to, in FP32 in
        a fixed order, rounded once to bfloat16; weights are not applied.

        Arguments:
            x: `torch.Tensor` bfloat16 ``[M, hidden]``, in the dispatch's row order.
            handle: the handle tuple of the dispatch.
            topk_weights: `torch.Tensor` ``[M, num_topk]`` float32 sent back and summed, or None.
            bias: None, one bfloat16 `torch.Tensor` ``[num_tokens, hidden]``, or a pair of them.
            config: a ``Config``, or None: ``get_combine_config(num_ranks)``.
            previous_event: an ``EventOverlap`` the call waits for first, or None.
            async_finish: bool, default False: return at once with the call's event.
            allocate_on_comm_stream: bool, default False; True requires ``previous_event`` and
                ``async_finish``.

        Returns:
            combined_x: `torch.Tensor` bfloat16 ``[num_tokens, hidden]``.
            combined_topk_weights: `torch.Tensor` ``[num_tokens, num_topk]`` float32, the sum of the
                weight rows the ranks returned; None without ``topk_weights``.
            event: an ``EventOverlap`` (wrapping None unless ``async_finish``).
        """
        combined, combined_w, ev = self._rt().combine(x, native_handle(handle), topk_weights, bias_list(bias), config,
                                                      _native(previous_event, "previous_event"), async_finish,
                                                      allocate_on_comm_stream)
        return combined, combined_w, _overlap(ev, async_finish)

    # ---- low-latency mode ----------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Collective: resets both low-latency slots for a shape; needed after a normal-mode call
        used the scale-out pool and before low-latency calls of another shape.

        Arguments:
            num_max_dispatch_tokens_per_rank: int, ``N`` of the next low-latency calls.
            hidden: int, their hidden size.
            num_experts: int, their experts.
        """
        runtime = self._rt()
        # Collective: a rank whose arguments are not integers it can take takes part as a rejection
        # (its peers raise PeerError naming it), then raises its own error. No exchange of its own:
        # in shrink mode the call goes on without failed ranks, which no other collective could.
        shape = Conversions()
        n = shape.int32(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
        h, e = shape.int32(hidden, "hidden"), shape.int32(num_experts, "num_experts")
        try:
            runtime.clean_low_latency_buffer(n, h, e, shape.rejection)
        except _C.InvalidArgument:
            if shape.error is not None:
                raise shape.error from None
            raise

    def _low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                              use_ue8m0, async_finish, return_recv_hook, topk_weights=None, x_global_scale=None,
                              use_nvfp4=False, use_ue8m0_for_sf=False):
        recv_x, recv_sf, count, native, ev, hook, weights, ranks = self._rt().low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, x_global_scale, use_fp8, round_scale,
            use_ue8m0, use_nvfp4, use_ue8m0_for_sf, async_finish, return_recv_hook)
        handle = HandleTuple(native.fields(), native)  # its tensors exist from the start
        packed = (recv_x, recv_sf) if use_fp8 or use_nvfp4 else recv_x
        out = (packed, count, handle, _overlap(ev, async_finish), hook)
        return out if topk_weights is None else out + (weights, ranks)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        """Collective (low-latency mode): sends each token to every expert of its top-k, into a
        slab ``[num_local_experts, num_ranks * N, hidden]``; rows in source-rank blocks, token order.

        Arguments:
            x: `torch.Tensor` ``[num_tokens, hidden]`` bfloat16, ``num_tokens <= N``.
            topk_idx: `torch.Tensor` ``[num_tokens, num_topk]`` int64, -1 for none.
            num_max_dispatch_tokens_per_rank: int, ``N``, the same on every rank and call until a clean.
            num_experts: int, the experts.
            cumulative_local_expert_recv_stats: `torch.Tensor` ``[num_local_experts]`` int32 the
                received counts are added to, or None.
            dispatch_wait_recv_cost_stats: `torch.Tensor` ``[num_ranks]`` int64 the nanoseconds waited
                for each source are added to, or None.
            use_fp8: bool, default True: cast to float8_e4m3fn with per-128 scales.
            round_scale: bool, default False: scales rounded up to powers of two.
            use_ue8m0: bool, default False: scales as packed UE8M0 exponents (needs ``round_scale``).
            async_finish: bool, default False: return at once with the call's event.
            return_recv_hook: bool, default False: send now, receive when the returned hook is called
                (not with ``async_finish``).

        Returns:
            recv_x: `torch.Tensor` bfloat16 ``[num_local_experts, num_ranks * N, hidden]``, or with
                ``use_fp8`` the pair (float8_e4m3fn slab, scales float32
                ``[..., hidden / 128]`` or int32 ``[..., ceil(hidden / 512)]``, token stride 1).
            packed_recv_count: `torch.Tensor` ``[num_local_experts]`` int32, the valid rows per expert.
            handle: ``(src_info [num_local_experts, num_ranks * N] int32, layout_range
                [num_local_experts, num_ranks] int64, N, hidden, num_experts)``.
            event: an ``EventOverlap`` (wrapping None unless ``async_finish``).
            hook: a callable completing the receive with ``return_recv_hook``, else None.
        """
        return self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                          cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                          round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        """Collective (low-latency mode): returns to every token the weighted sum of its experts'
        rows, ``bf16(sum_j w_j * y_j)`` over its valid lanes in order (docs/legacy.md §4).

        Arguments:
            x: `torch.Tensor` bfloat16 ``[num_local_experts, num_ranks * N, hidden]``, the expert
                outputs in the dispatch's slab layout (only the shape with ``zero_copy``).
            topk_idx: `torch.Tensor` ``[num_tokens, num_topk]`` int64, the dispatched ids (-1 may
                replace one: that lane is left out).
            topk_weights: `torch.Tensor` ``[num_tokens, num_topk]`` float32.
            handle: the handle tuple of the low-latency dispatch.
            use_logfmt: bool, default False: LogFMT-10 compression of the rows (not with ``zero_copy``).
            zero_copy: bool, default False: the outputs are already in
                ``get_next_low_latency_combine_buffer(handle)``.
            async_finish: bool, default False: return at once with the call's event.
            return_recv_hook: bool, default False: send now, reduce when the returned hook is called.
            out: `torch.Tensor` ``[num_tokens, hidden]`` bfloat16 to write into, or None.
            combine_wait_recv_cost_stats: `torch.Tensor` ``[num_ranks]`` int64 the nanoseconds waited
                for each source are added to, or None.

        Returns:
            combined_x: `torch.Tensor` bfloat16 ``[num_tokens, hidden]`` (``out`` when given).
            event: an ``EventOverlap`` (wrapping None unless ``async_finish``).
            hook: a callable completing the combine with ``return_recv_hook``, else None.
        """
        return self._low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                         return_recv_hook, out, combine_wait_recv_cost_stats)

    def _low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                             return_recv_hook, out, combine_wait_recv_cost_stats, overlap=False, src_signals=None,
                             src_signal_expect_value=0):
        combined, ev, hook = self._rt().low_latency_combine(x, topk_idx, topk_weights, native_handle(handle),
                                                            use_logfmt, zero_copy,
                                                            async_finish, return_recv_hook, out,
                                                            combine_wait_recv_cost_stats, overlap, src_signals,
                                                            src_signal_expect_value)
        return combined, _overlap(ev, async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle):
        """Where a ``zero_copy`` combine of this dispatch reads the expert outputs: write them there.

        Arguments:
            handle: the handle tuple of a ``low_latency_dispatch``.

        Returns:
            buffer: `torch.Tensor` bfloat16 ``[num_local_experts, num_ranks * N, hidden]``, row stride
                ``hidden + 2 * ceil(hidden / 128)`` (DeepEP's layout); it keeps the pool mapped.
        """
        native = native_handle(handle)
        if not isinstance(native, _C.LowLatencyHandle):
            raise TypeError(f"handle must be a handle returned by low_latency_dispatch, not {type(handle).__name__}")
        return self._rt().get_next_low_latency_combine_buffer(native)
