"""moe-ep: expert-parallel token dispatch and combine for Mixture-of-Experts models.

``moe_ep.deep_ep`` is DeepEP's Python API (``Buffer``, ``ElasticBuffer``, ...) on moe-ep's C++
buffers; ``moe_ep.TokenDispatcher`` is the framework-facing dispatcher. Groups are
``torch.distributed`` process groups (processes of one host), mpi4py communicators, or threads of
this process (``LocalWorld``). Tensors are torch CPU tensors (numpy arrays are accepted as inputs);
outputs are torch tensors over moe-ep memory, exchanged through DLPack without a copy.
See docs/python.md.
"""

from . import _C
from ._C import (CapacityError, Error, InvalidArgument, PeerError, ResourceError, StateError,
                 TimeoutError, Group)
from ._groups import LocalWorld, resolve_group
from ._dispatcher import BufferCache, TokenDispatcher, env, probe_providers
from ._memory import empty, empty_like, zeros

__version__ = _C.__version__  # the C++ library's version (CMakeLists.txt's project version)

__all__ = [
    "Error", "InvalidArgument", "CapacityError", "StateError", "ResourceError", "PeerError", "TimeoutError",
    "Group", "LocalWorld", "resolve_group", "BufferCache", "TokenDispatcher", "probe_providers", "env", "empty", "empty_like", "zeros",
    "__version__",
]
