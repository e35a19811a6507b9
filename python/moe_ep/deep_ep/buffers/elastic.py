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
    """The routing state of a non-cached dispatch (DeepEP's fields)."""

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
        # The rows are already in ascending source order.
        return recv_x, recv_sf, recv_topk_idx, recv_topk_weights, channel_linked_list


class ElasticBuffer(EngramPPMixin, AgrsMixin):
    # Engram storage, PP send/receive and barrier: EngramPPMixin (_engram_pp.py); the all-gather
    # sessions: AgrsMixin (_agrs.py).
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
        return EventHandle()

    def get_comm_stream(self):
        """The stream communication is ordered on: with the CUDA provider the caller's current stream
        (each call runs on it), on CPU torch's CPU stream (calls run in call order on the host)."""
        if self._provider == "cuda":
            return torch.cuda.current_stream(self._device)
        return torch.cpu.current_stream()

    def _rt(self):
        if self.runtime is None:
            raise _C.StateError(f"[rank {self.rank_idx}] the buffer was destroyed")
        return self.runtime

    def destroy(self):
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._rt().destroy()
        self.runtime = None

    def get_physical_domain_size(self):
        return self._rt().get_physical_domain_size()

    def get_logical_domain_size(self):
        return self._rt().get_logical_domain_size()

    def get_theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, nvlink_gbs=0,
                                sm_read_gbs=200, sm_write_gbs=50):
        read = 0 if sm_read_gbs == _DEFAULT_SM_READ_GBS else sm_read_gbs
        write = 0 if sm_write_gbs == _DEFAULT_SM_WRITE_GBS else sm_write_gbs
        return self._rt().get_theoretical_num_sms(int32(num_experts, "num_experts"), int32(num_topk, "num_topk"),
                                                  int32(num_scaleout_topk, "num_scaleout_topk"), rdma_gbs, nvlink_gbs,
                                                  read, write)

    def get_theoretical_num_qps(self, num_sms):
        return self._rt().get_theoretical_num_qps(int32(num_sms, "num_sms", 0, MAX_WORKERS))

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
                 num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None,
                 previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False,
                 handle=None, do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False):
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
        native = handle._native if isinstance(handle, EPHandle) else handle
        combined, combined_w, ev = self._rt().combine(
            x, native, topk_weights, bias_list(bias), num_sms, num_qps,
            _native(previous_event, "previous_event"),
            _native(previous_event_before_epilogue, "previous_event_before_epilogue"), async_with_compute_stream,
            allocate_on_comm_stream, self._stream())
        return combined, combined_w, _overlap(ev, async_with_compute_stream)
