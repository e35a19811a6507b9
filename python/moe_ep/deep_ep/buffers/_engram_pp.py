"""DeepEP V2 ``ElasticBuffer``'s Engram storage, pipeline-parallel send/receive and barrier, on
moe-ep's C++ buffer (docs/engram-pp.md). ``ElasticBuffer`` inherits these methods.

Signatures and defaults are DeepEP's (2.1.0). Everything runs synchronously on the host, in call
order: ``engram_fetch`` reads the rows in the call and returns a hook that returns them;
``pp_send`` returns once the tensor's bytes are in the receiver's slot. The GPU-only knobs
(``num_qps``, ``num_sms``, the barrier's flags) are checked and otherwise ignored. Arguments of the
collective calls (``engram_write``, ``pp_set_config``, ``barrier``) are converted by the extension,
so a rank whose arguments it cannot convert still takes part and its peers raise PeerError.
"""

import torch

from ... import _C
from ..._arguments import int32, int64
from ._common import not_on_cpu


def _on_cpu_provider(buffer, what):
    if buffer._provider == "cuda":
        not_on_cpu(f"{what} (on the cuda provider)")


class EngramPPMixin:
    """Engram, PP and barrier methods of ``ElasticBuffer`` (``self._rt()`` is the C++ buffer)."""

    @staticmethod
    def get_engram_storage_size_hint(num_entries, hidden, num_max_tokens_per_rank, dtype=torch.bfloat16):
        """(gpu, cpu) bytes: the fetch output of ``num_max_tokens_per_rank`` rows and the storage of
        ``num_entries`` rows, each row ``hidden`` elements rounded up to 32 bytes, both 2 MiB aligned."""
        return _C.ElasticBuffer.get_engram_storage_size_hint(int64(num_entries, "num_entries"), int64(hidden, "hidden"),
                                                             int64(num_max_tokens_per_rank, "num_max_tokens_per_rank"),
                                                             str(dtype).split(".")[-1])

    def engram_write(self, storage, sf=None):
        """Collective: stores this rank's ``[num_entries, hidden]`` shard (bfloat16, or float8_e4m3fn
        with ``sf``: the scales of every rank's entries, ``[R * num_entries, P]`` float32 or int32,
        kept by reference)."""
        _on_cpu_provider(self, "engram_write")
        self._rt().engram_write(storage, sf)
        self._engram_sf = sf

    def engram_fetch(self, indices, num_qps=0, use_tma_aligned_col_major_sf=False):
        """Rows by global index (``indices`` int32 ``[T, K]``); returns a hook returning
        ``(data [T, K * hidden], sf_out [T, K * P] or None)``."""
        _on_cpu_provider(self, "engram_fetch")
        data, sf_out = self._rt().engram_fetch(indices, int32(num_qps, "num_qps"), use_tma_aligned_col_major_sf)

        def hook():
            return data, sf_out
        return hook

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors):
        return _C.ElasticBuffer.get_pp_buffer_size_hint(int64(num_max_tensor_bytes, "num_max_tensor_bytes"),
                                                        int64(num_max_inflight_tensors, "num_max_inflight_tensors"))

    def pp_set_config(self, num_max_tensor_bytes, num_max_inflight_tensors):
        """Collective: messages of at most ``num_max_tensor_bytes`` (rounded up to 32), at most
        ``num_max_inflight_tensors`` unreceived per (sender, receiver)."""
        _on_cpu_provider(self, "pp_set_config")
        self._rt().pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)

    def pp_send(self, t, dst_rank_idx, num_sms=0):
        """Sends ``t`` (contiguous, a multiple of 32 bytes) to a ring neighbour."""
        _on_cpu_provider(self, "pp_send")
        self._rt().pp_send(t, int32(dst_rank_idx, "dst_rank_idx"), int32(num_sms, "num_sms"))

    def pp_recv(self, t, src_rank_idx, num_sms=0):
        """Receives the next message from a ring neighbour into ``t`` (of the message's size)."""
        _on_cpu_provider(self, "pp_recv")
        self._rt().pp_recv(t, int32(src_rank_idx, "src_rank_idx"), int32(num_sms, "num_sms"))

    def barrier(self, use_comm_stream=True, with_cpu_sync=False, sequential=True):
        """Collective: a full barrier over every rank, whatever the flags."""
        self._rt().barrier(use_comm_stream, with_cpu_sync, sequential)
