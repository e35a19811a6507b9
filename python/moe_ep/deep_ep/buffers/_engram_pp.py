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
        """The bytes an Engram table needs (build the buffer with ``num_bytes = gpu + cpu,
        num_cpu_bytes = cpu``); local. Each row is ``hidden`` elements rounded up to 32 bytes.

        Arguments:
            num_entries: int, the rows of this rank's shard.
            hidden: int, the elements of a row.
            num_max_tokens_per_rank: int, the most rows one fetch returns (``T * K``).
            dtype: the ``torch.dtype`` of the rows, default ``torch.bfloat16``.

        Returns:
            gpu: int, the fetch output of ``num_max_tokens_per_rank`` rows, 2 MiB aligned.
            cpu: int, the storage of ``num_entries`` rows, 2 MiB aligned.
        """
        return _C.ElasticBuffer.get_engram_storage_size_hint(int64(num_entries, "num_entries"), int64(hidden, "hidden"),
                                                             int64(num_max_tokens_per_rank, "num_max_tokens_per_rank"),
                                                             str(dtype).split(".")[-1])

    def engram_write(self, storage, sf=None):
        """Collective: stores this rank's shard of the table (global row ``g`` is row
        ``g % num_entries`` of rank ``g // num_entries``); every fetch after it reads the new shards.

        Arguments:
            storage: `torch.Tensor` ``[num_entries, hidden]`` bfloat16, or float8_e4m3fn with ``sf``;
                contiguous, at most ``num_cpu_bytes`` bytes.
            sf: `torch.Tensor` ``[num_ranks * num_entries, P]`` float32 or int32 (packed UE8M0): the
                scales of every rank's entries, given iff ``storage`` is FP8; kept by reference.
        """
        _on_cpu_provider(self, "engram_write")
        self._rt().engram_write(storage, sf)
        self._engram_sf = sf

    def engram_fetch(self, indices, num_qps=0, use_tma_aligned_col_major_sf=False):
        """Rows of the table by global index, read now without the peers taking part.

        Arguments:
            indices: `torch.Tensor` ``[T, K]`` int32, contiguous, values in
                ``[0, num_ranks * num_entries)``.
            num_qps: int, default 0, in ``[0, num_allocated_qps]``; a hint.
            use_tma_aligned_col_major_sf: bool, default False: ``sf_out`` column-major, strides
                ``(1, a(T, 4))``.

        Returns:
            hook: a callable returning ``(data, sf_out)``: ``data`` `torch.Tensor`
                ``[T, K * hidden]`` (float8_e4m3fn when the write had scales, else bfloat16), row
                ``t`` the rows ``indices[t]`` side by side; ``sf_out`` ``[T, K * P]`` in the scales'
                dtype, or None without scales. Both are new tensors.
        """
        _on_cpu_provider(self, "engram_fetch")
        data, sf_out = self._rt().engram_fetch(indices, int32(num_qps, "num_qps"), use_tma_aligned_col_major_sf)

        def hook():
            return data, sf_out
        return hook

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors):
        """The bytes PP send/receive needs: ``a(a(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 4,
        2 MiB)``; local.

        Arguments:
            num_max_tensor_bytes: int, the largest message.
            num_max_inflight_tensors: int, the messages a channel holds unreceived.

        Returns:
            num_bytes: int.
        """
        return _C.ElasticBuffer.get_pp_buffer_size_hint(int64(num_max_tensor_bytes, "num_max_tensor_bytes"),
                                                        int64(num_max_inflight_tensors, "num_max_inflight_tensors"))

    def pp_set_config(self, num_max_tensor_bytes, num_max_inflight_tensors):
        """Collective: opens the FIFO channels between ring neighbours (ranks ``r - 1`` and
        ``r + 1``); refused while a message sent is not yet received.

        Arguments:
            num_max_tensor_bytes: int > 0, the largest message (rounded up to 32 bytes).
            num_max_inflight_tensors: int > 0, the messages unreceived per (sender, receiver).
        """
        _on_cpu_provider(self, "pp_set_config")
        self._rt().pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)

    def pp_send(self, t, dst_rank_idx, num_sms=0):
        """Sends a tensor's bytes to a ring neighbour; returns once they are in its slot (waits while
        the channel is full).

        Arguments:
            t: `torch.Tensor`, contiguous, a multiple of 32 bytes, at most ``num_max_tensor_bytes``.
            dst_rank_idx: int, the previous or the next rank of the ring.
            num_sms: int, default 0, in ``[0, 1024]``; a hint.
        """
        _on_cpu_provider(self, "pp_send")
        self._rt().pp_send(t, int32(dst_rank_idx, "dst_rank_idx"), int32(num_sms, "num_sms"))

    def pp_recv(self, t, src_rank_idx, num_sms=0):
        """Receives the next message from a ring neighbour into a tensor (waits for it).

        Arguments:
            t: `torch.Tensor`, contiguous, of exactly the message's bytes (dtype and shape do not
                travel).
            src_rank_idx: int, the previous or the next rank of the ring.
            num_sms: int, default 0, in ``[0, 1024]``; a hint.
        """
        _on_cpu_provider(self, "pp_recv")
        self._rt().pp_recv(t, int32(src_rank_idx, "src_rank_idx"), int32(num_sms, "num_sms"))

    def barrier(self, use_comm_stream=True, with_cpu_sync=False, sequential=True):
        """Collective: a full host barrier over every rank, after this rank's queued asynchronous
        calls, whatever the flags.

        Arguments:
            use_comm_stream: bool, default True; DeepEP's stream choice, no effect.
            with_cpu_sync: bool, default False; DeepEP's device syncs, no effect.
            sequential: bool, default True; DeepEP's order of the node and scale-out barriers, no
                effect.
        """
        self._rt().barrier(use_comm_stream, with_cpu_sync, sequential)
