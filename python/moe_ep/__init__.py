"""moe-ep: expert-parallel token dispatch and combine for Mixture-of-Experts models.

``moe_ep.deep_ep`` is DeepEP's Python API (``Buffer``, ``ElasticBuffer``, ...) on moe-ep's C++
buffers; ``moe_ep.TokenDispatcher`` is the framework-facing dispatcher. Groups are
``torch.distributed`` process groups (processes of one host), mpi4py communicators, or threads of
this process (``LocalWorld``). Tensors are torch CPU tensors (numpy arrays are accepted as inputs),
or torch CUDA tensors for a ``deep_ep.ElasticBuffer`` backed by the CUDA provider; outputs are
torch tensors over moe-ep memory, exchanged through DLPack without a copy.
See docs/python.md.
"""

import re as _re

import torch as _torch

# The torch versions moe-ep supports (docs/python.md): float8_e4m3fn, DLPack for every dtype moe-ep
# moves, and gloo's bfloat16 all arrived by 2.1; 3.x is unknown.
_TORCH_RANGE = ((2, 1), (3, 0))


def _check_torch(version):
    m = _re.match(r"(\d+)\.(\d+)", version)
    if m is None or not _TORCH_RANGE[0] <= (int(m.group(1)), int(m.group(2))) < _TORCH_RANGE[1]:
        low, high = _TORCH_RANGE
        raise ImportError(f"moe_ep needs torch >= {low[0]}.{low[1]} and < {high[0]}.{high[1]}; this interpreter "
                          f"has torch {version} (scripts/python-env.sh makes the project's environment)")


_check_torch(_torch.__version__)

try:
    from . import _C  # noqa: E402  (after the torch check)
except ImportError as _error:
    from ._features import explain_missing_extension as _explain
    raise _explain(_error) from None
from ._C import (CapacityError, Error, InvalidArgument, PeerError, ResourceError, StateError,  # noqa: E402
                 TimeoutError, Group)
from ._groups import LocalWorld, resolve_group  # noqa: E402
from ._dispatcher import BufferCache, TokenDispatcher, env, probe_providers  # noqa: E402
from ._memory import empty, empty_like, zeros  # noqa: E402
from ._features import features  # noqa: E402

__version__ = _C.__version__  # the C++ library's version (CMakeLists.txt's project version)

__all__ = [
    "Error", "InvalidArgument", "CapacityError", "StateError", "ResourceError", "PeerError", "TimeoutError",
    "Group", "LocalWorld", "resolve_group", "BufferCache", "TokenDispatcher", "probe_providers", "env", "empty", "empty_like", "zeros",
    "features", "__version__",
]
