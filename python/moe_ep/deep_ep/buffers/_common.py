"""Helpers shared by the two buffer generations' Python classes."""

import collections.abc

import torch

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


# Argument errors must reach every rank of a collective call: the wrappers below do not raise;
# the extension converts the arguments and, when one cannot be converted on this rank, still
# takes part in the call as a rejection (peers raise PeerError naming this rank) before raising.


def bias_list(bias):
    """None -> [], a tensor -> [it], a sequence as is (the extension checks what it holds)."""
    if bias is None:
        return []
    if isinstance(bias, torch.Tensor):
        return [bias]
    return bias


def or_default(value, default):
    return default if value is None else value


class HandleTuple(tuple):
    """One of DeepEP's handle tuples that also carries the moe-ep handle behind it (``_native``)."""

    def __new__(cls, items, native):
        t = super().__new__(cls, items)
        t._native = native
        return t


class DeferredHandleTuple(collections.abc.Sequence):
    """DeepEP's handle tuple of an asynchronous call, whose handle the communication worker fills:
    indexing, unpacking and ``len`` work as on the tuple; the items are read on first use, after
    the call's event completed (``_native`` is the moe-ep handle)."""

    def __init__(self, native, event, items):
        self._native = native
        self._event = event
        self._items_of = items
        self._items = None

    def _resolve(self):
        if self._items is None:
            if self._event is not None and not self._event.query():
                self._event.wait()
            self._items = tuple(self._items_of(self._native))
        return self._items

    def __getitem__(self, i):
        return self._resolve()[i]

    def __len__(self):
        return len(self._resolve())

    def __repr__(self):
        return f"DeferredHandleTuple{self._resolve()!r}"


def native_handle(handle):
    """The moe-ep handle behind one of DeepEP's handle tuples (anything else passes through, for
    the extension to refuse)."""
    return getattr(handle, "_native", handle)
