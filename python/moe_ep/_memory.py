"""Tensors in moe-ep's own memory.

Inputs that live in moe-ep's memory are read in place by the ranks of the node; other memory
(torch's own allocations) is copied once into the rank's shared arena before node peers read it,
because another process cannot map it (docs/python.md, "Zero copy"). Allocate with
``moe_ep.empty`` what will be dispatched or combined (e.g. write the expert outputs into it with
``out=``) to skip that copy; outputs of dispatch and combine are already in moe-ep's memory.
"""

import torch

from . import _C
from ._arguments import int64

# torch dtype -> its name, for every dtype moe-ep moves (the library's table: _C.dtype_names()).
_NAMES = {getattr(torch, name): name for name in _C.dtype_names()}


def empty(*size, dtype=torch.bfloat16):
    """An uninitialised torch tensor of ``size`` in moe-ep's memory (64-byte aligned)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if dtype not in _NAMES:
        raise TypeError(f"dtype must be one of {', '.join(str(d) for d in _NAMES)}, not {dtype}")
    return _C.empty([int64(s, f"size[{i}]", 0) for i, s in enumerate(size)], _NAMES[dtype])


def zeros(*size, dtype=torch.bfloat16):
    """A zeroed torch tensor of ``size`` in moe-ep's memory."""
    return empty(*size, dtype=dtype).zero_()


def empty_like(t):
    """``empty`` of ``t``'s shape and dtype: ``t`` is a dense torch tensor (layout torch.strided; its
    device does not matter, only its shape and dtype are read)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        what = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"t has {what}; empty_like takes dense tensors (layout torch.strided)")
    return empty(t.shape, dtype=t.dtype)
