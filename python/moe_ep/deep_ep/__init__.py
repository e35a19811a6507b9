"""DeepEP's Python API (``deep_ep`` 2.1.0) on moe-ep: an engine's DeepEP code runs on CPU tensors
by importing this module in place of ``deep_ep`` (or by putting the alias directory
``build/deep_ep_alias`` on PYTHONPATH, which makes ``import deep_ep`` resolve here).
Differences from DeepEP are listed in docs/python.md."""

import torch

from .._groups import resolve_group
from .buffers.elastic import ElasticBuffer, EPHandle
from .buffers.legacy import Buffer, Config
from .hybrid_ep_buffer import HybridEPBuffer, HybridEpConfigInstance
from .utils import EventHandle, EventOverlap
from . import cpu_compat

topk_idx_t = torch.int64
__version__ = "2.1.0"


def get_physical_domain_size(group):
    """The physical domains of a group: its nodes, and the ranks of each, as the transport sees them.

    Arguments:
        group: a ``torch.distributed.ProcessGroup``, an mpi4py communicator or a ``moe_ep.Group``.

    Returns:
        num_rdma_ranks: int, the nodes (``MOE_EP_RANKS_PER_NODE`` or ``LocalWorld``'s
            ``num_scaleout`` make logical ones).
        num_nvl_ranks: int, the ranks of each node (they share memory).
    """
    g = resolve_group(group)
    return g.num_scaleout, g.num_scaleup


def get_logical_domain_size(group, allow_hybrid_mode=True):
    """The domains V2's dispatch and combine work in: the physical ones with hybrid mode, else one.

    Arguments:
        group: a ``torch.distributed.ProcessGroup``, an mpi4py communicator or a ``moe_ep.Group``.
        allow_hybrid_mode: bool, default True; False makes every rank one scale-up domain.

    Returns:
        num_scaleout_ranks: int, the scale-out domains (1 without hybrid mode).
        num_scaleup_ranks: int, the ranks of each.
    """
    g = resolve_group(group)
    return (g.num_scaleout, g.num_scaleup) if allow_hybrid_mode else (1, g.size())


cpu_compat._install_from_environment()  # MOE_EP_CPU_COMPAT=1 (off by default)

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "HybridEPBuffer", "HybridEpConfigInstance", "EventOverlap", "EventHandle", "Config", "topk_idx_t",
           "get_physical_domain_size", "get_logical_domain_size", "__version__"]
