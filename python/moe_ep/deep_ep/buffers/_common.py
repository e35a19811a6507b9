"""Helpers shared by the two buffer generations' Python classes."""

import torch

from ... import _C
from ..._groups import resolve_group


def group_of(group, comm, name="group"):
    if group is None and comm is None:
        raise ValueError("group or comm is required (a torch.distributed.ProcessGroup, an mpi4py communicator "
                         "or a moe_ep.Group)")
    if group is not None and comm is not None:
        raise ValueError("give group or comm, not both")
    return resolve_group(group if group is not None else comm, "group" if group is not None else "comm")


def not_on_cpu(what):
    raise NotImplementedError(f"{what} has no CPU counterpart in moe-ep (docs/python.md lists the differences)")


def require_false(value, name, why):
    if value:
        raise NotImplementedError(f"{name}=True is not supported by moe-ep: {why}")


def bias_list(bias):
    if bias is None:
        return []
    if isinstance(bias, torch.Tensor):
        return [bias]
    if isinstance(bias, (tuple, list)):
        if len(bias) > 2:
            raise ValueError(f"bias is a sequence of {len(bias)} tensors; at most 2 are accepted")
        return list(bias)
    raise TypeError(f"bias must be None, a tensor or a pair of tensors, not {type(bias).__name__}")


def int_or(value, default, name):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    return value


class NativeTuple(tuple):
    """A tuple (DeepEP's handle shapes) that also carries the moe-ep handle behind it."""

    def __new__(cls, items, native):
        t = super().__new__(cls, items)
        t._native = native
        return t


def native_handle(handle, kind, name="handle"):
    if handle is None:
        return None
    native = getattr(handle, "_native", None)
    if not isinstance(native, kind):
        raise TypeError(f"{name} must be a handle returned by this buffer's dispatch, not {type(handle).__name__}")
    return native
