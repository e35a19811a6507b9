"""Groups: what ``group`` arguments may be, and how each becomes a moe-ep group.

- a ``torch.distributed.ProcessGroup`` (any backend; gloo on CPU): the processes must run on one
  host. They bootstrap moe-ep's host transport with one ``all_gather_object`` on the group; after
  that no data travels through the group. One moe-ep group is made per process group and reused.
- an mpi4py communicator: moe-ep's MPI transport (across hosts).
- a ``moe_ep.Group`` (from ``LocalWorld.run``): used as is.
"""

import threading

from . import _C
from ._arguments import int32, optional_int32

_lock = threading.Lock()
_cache = {}  # id(process group or communicator) -> (the object, its moe_ep.Group)
# Wrappers of LocalWorld.run's per-rank function (moe_ep.deep_ep.cpu_compat registers one while
# installed, so that each rank's thread gets its device mapping).
rank_thread_wrappers = []


class LocalWorld:
    """``num_ranks`` ranks as threads of this process.

    ``run(fn)`` calls ``fn(group)`` on every rank's thread and returns the list of results (by
    rank). If ranks raise, it re-raises the root cause: the lowest rank's exception that is not a
    ``moe_ep.PeerError`` (a reaction to another rank), else the lowest rank's. ``num_scaleout``
    nodes of ``num_ranks / num_scaleout`` ranks make the multi-node paths run in one process.
    """

    def __init__(self, num_ranks, num_scaleout=1):
        num_ranks = int32(num_ranks, "num_ranks", 1)
        num_scaleout = int32(num_scaleout, "num_scaleout", 1)
        if num_ranks % num_scaleout:
            raise _C.InvalidArgument(f"num_scaleout = {num_scaleout} must divide num_ranks = {num_ranks}")
        self.num_ranks = num_ranks
        self.num_scaleout = num_scaleout

    def run(self, fn):
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        for wrap in list(rank_thread_wrappers):
            fn = wrap(fn)
        return _C.run_local_world(self.num_ranks, self.num_scaleout, self.num_ranks // self.num_scaleout, fn)


def _is_process_group(group):
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return isinstance(group, dist.ProcessGroup)


def _is_mpi_comm(group):
    cls = type(group)
    if not cls.__module__.startswith("mpi4py"):
        return False
    from mpi4py import MPI
    return isinstance(group, MPI.Comm)


def _host_group(group, ranks_per_node, timeout_secs):
    import torch
    import torch.distributed as dist

    size = group.size()

    def all_gather(mine):
        out = [None] * size
        # Engines call under torch.inference_mode(); gloo's all-gather writes its tensors from a
        # thread outside that mode, which torch refuses for inference tensors: make normal ones.
        with torch.inference_mode(False):
            dist.all_gather_object(out, mine, group=group)
        return out

    return _C.host_group(group.rank(), size, all_gather, ranks_per_node, timeout_secs)


def _mpi_group(comm, ranks_per_node, timeout_secs):
    from . import _features
    _C_mpi = _features.mpi_module()  # TypeError naming why, where this moe_ep has no MPI transport
    from mpi4py import MPI
    return _C_mpi.mpi_group(MPI._handleof(comm), ranks_per_node, timeout_secs)


def resolve_group(group, name="group", ranks_per_node=None, timeout_secs=0.0):
    """The moe_ep.Group for ``group`` (see the module docstring). Collective the first time a
    process group or communicator is seen."""
    if isinstance(group, _C.Group):
        return group
    if _is_process_group(group):
        make = _host_group
    elif _is_mpi_comm(group):
        make = _mpi_group
    else:
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup, an mpi4py communicator or a "
                        f"moe_ep.Group, not {type(group).__module__}.{type(group).__name__}")
    key = id(group)
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] is group:
            return hit[1]
    made = make(group, optional_int32(ranks_per_node, "ranks_per_node"), timeout_secs)
    with _lock:
        _cache[key] = (group, made)
    return made


def forget_group(group):
    """Drops the moe-ep group made for ``group`` (it is freed once no buffer uses it)."""
    with _lock:
        _cache.pop(id(group), None)
