"""DeepEP V2's all-gather sessions (AGRS) of ``ElasticBuffer``, on host tensors (docs/agrs.md).

Names, defaults and return values are DeepEP's. ``all_gather`` and ``agrs_get_inplace_tensor``
return views of this rank's session region: valid until the session ends (the next session reuses
the bytes). The handle ``all_gather`` returns is a no-op on the host, but keeps DeepEP's rule that
it is called inside the session of its call (``moe_ep.StateError`` otherwise).
"""

import contextlib
import operator

import torch

from ... import _C
from ..._arguments import int64
from ._common import group_of


def _one_shape(shape, name):
    try:
        sizes = [operator.index(size) for size in shape]
    except TypeError:
        raise TypeError(f"{name} must be a shape (a tuple of ints or a torch.Size), not {shape!r}") from None
    return [int64(size, f"{name}[{i}]") for i, size in enumerate(sizes)]


def _shapes(shapes):
    """(batched, [shape, ...]): DeepEP's rule, a sequence of shapes when shapes[0] is a tuple
    (torch.Size is one); an empty shape is one 0-d shape."""
    if not isinstance(shapes, (tuple, list, torch.Size)):
        raise TypeError(f"shapes must be a shape or a sequence of shapes, not {type(shapes).__name__}")
    if len(shapes) > 0 and isinstance(shapes[0], tuple):
        return True, [_one_shape(s, f"shapes[{i}]") for i, s in enumerate(shapes)]
    return False, [_one_shape(shapes, "shapes")]


def _dtype_name(dtype):
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
    return str(dtype).split(".")[-1]


class AgrsMixin:
    """The AGRS methods of ``ElasticBuffer`` (which provides ``_rt`` and ``_provider``)."""

    def _agrs(self, what):
        runtime = self._rt()
        if self._provider == "cuda":
            raise NotImplementedError(f"{what}: all-gather sessions move host tensors in moe-ep (the built-in "
                                      "provider); this buffer uses the CUDA provider")
        return runtime

    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype):
        """The session bytes the all-gathers of these shapes take: the sum over shapes of
        ``a(R * numel * itemsize, 32)``; local.

        Arguments:
            group: the group of the buffer.
            shapes: one shape (a tuple of ints or a ``torch.Size``) or a sequence of shapes.
            dtype: the ``torch.dtype`` of the tensors.

        Returns:
            num_max_session_bytes: int, for ``agrs_set_config``.
        """
        _, shape_list = _shapes(shapes)
        return _C.ElasticBuffer.get_agrs_num_max_session_bytes(group_of(group, None), shape_list, _dtype_name(dtype))

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes):
        """The session region's bytes, ``num_max_session_bytes`` rounded up to 2 MiB; local.

        Arguments:
            group: the group of the buffer.
            num_max_session_bytes: int, from ``get_agrs_num_max_session_bytes``.

        Returns:
            num_bytes: int.
        """
        return _C.ElasticBuffer.get_agrs_buffer_size_hint(group_of(group, None),
                                                          int64(num_max_session_bytes, "num_max_session_bytes"))

    def agrs_set_config(self, num_max_session_bytes, num_max_all_gathers_per_session):
        """Collective: allocates the session region (beside the dispatch pool).

        Arguments:
            num_max_session_bytes: int in ``[1, num_bytes]``, the bytes one session's all-gathers
                may take.
            num_max_all_gathers_per_session: int, at most 32.
        """
        self._agrs("agrs_set_config").agrs_set_config(num_max_session_bytes, num_max_all_gathers_per_session)

    def create_agrs_session(self):
        """Starts a session on this rank (local); its all-gathers fill the session region."""
        self._agrs("create_agrs_session").create_agrs_session()

    def destroy_agrs_session(self):
        """Collective: ends the session on every rank; its results' views may then be reused."""
        self._agrs("destroy_agrs_session").destroy_agrs_session()

    @contextlib.contextmanager
    def agrs_new_session(self, enabled=True):
        """A context manager: ``create_agrs_session`` on entry, ``destroy_agrs_session`` on exit.

        Arguments:
            enabled: bool, default True; False makes it do nothing.
        """
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes, dtype):
        """Views of this rank's session region where the next ``all_gather`` calls take this
        rank's inputs from (write them there to save a copy).

        Arguments:
            shapes: one shape, or a sequence of shapes (one view each).
            dtype: the ``torch.dtype`` of the views.

        Returns:
            tensor: a `torch.Tensor` of that shape, or a tuple of them for a sequence of shapes.
        """
        batched, shape_list = _shapes(shapes)
        tensors = self._agrs("agrs_get_inplace_tensor").agrs_get_inplace_tensor(shape_list, _dtype_name(dtype))
        return tuple(tensors) if batched else tensors[0]

    def all_gather(self, t):
        """Collective: every rank's tensor, gathered into this rank's session region (call it in a
        session).

        Arguments:
            t: a `torch.Tensor` of shape ``S``, or a sequence of tensors (one all-gather each).

        Returns:
            gathered: `torch.Tensor` ``[num_ranks, *S]`` per input (views valid until the session
                ends), then the wait handle: a no-op callable on the host that must be called in
                the same session.
        """
        batched = not isinstance(t, torch.Tensor)
        gathered, handle = self._agrs("all_gather").all_gather(t, batched)
        return (*gathered, handle) if batched else (gathered[0], handle)
