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
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._rt().destroy()
        self.runtime = None

    @staticmethod
    def is_sm90_compiled():
        return False

    @staticmethod
    def set_num_sms(new_num_sms):
        new_num_sms = int32(new_num_sms, "new_num_sms")
        assert new_num_sms % 2 == 0, "The SM count must be even"
        _C.Buffer.set_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        return _C.Buffer.get_low_latency_rdma_size_hint(
            int32(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank"), int32(hidden, "hidden"),
            int32(num_ranks, "num_ranks"), int32(num_experts, "num_experts"))

    @staticmethod
    def get_dispatch_config(num_ranks):
        return _C.Buffer.get_dispatch_config(int32(num_ranks, "num_ranks"))

    @staticmethod
    def get_combine_config(num_ranks):
        return _C.Buffer.get_combine_config(int32(num_ranks, "num_ranks"))

    def get_comm_stream(self):
        """The stream communication is ordered on: on CPU every call runs in call order on the host,
        so it is torch's CPU stream (``torch.cpu.current_stream()``)."""
        return torch.cpu.current_stream()

    # ---- shrink mode (enable_shrink=True; docs/legacy.md §4) ---------------------------------
    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (or unmasks) a peer for this rank's low-latency calls; local."""
        self._rt().low_latency_update_mask_buffer(int32(rank_to_mask, "rank_to_mask"), mask)

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes this rank's mask into ``mask_status`` (int32 ``[R]``, 1 where masked)."""
        self._rt().low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank; local."""
        self._rt().low_latency_clean_mask_buffer()

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """A raw view of this rank's own buffer from byte ``offset`` on: the scale-up buffer
        (``num_nvl_bytes``, host memory used by nothing else) or, with ``use_rdma_buffer``, the
        scale-out pool (``num_rdma_bytes``, where the low-latency slots live); 1-D of ``dtype``, or
        its first ``size.numel()`` elements shaped ``size``. It keeps the memory alive."""
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
        combined, combined_w, ev = self._rt().combine(x, native_handle(handle), topk_weights, bias_list(bias), config,
                                                      _native(previous_event, "previous_event"), async_finish,
                                                      allocate_on_comm_stream)
        return combined, combined_w, _overlap(ev, async_finish)

    # ---- low-latency mode ----------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
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
        return self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                          cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                          round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
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
        native = native_handle(handle)
        if not isinstance(native, _C.LowLatencyHandle):
            raise TypeError(f"handle must be a handle returned by low_latency_dispatch, not {type(handle).__name__}")
        return self._rt().get_next_low_latency_combine_buffer(native)
