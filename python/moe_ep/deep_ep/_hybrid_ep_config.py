"""HybridEPBuffer's configuration (``HybridEpConfigInstance``), its validity rules, the NVLink
domain size and the Python-level agreement of HybridEPBuffer's collective calls
(docs/hybrid-ep.md)."""

import functools
import os
import pickle

import torch

from .. import _C
from .._arguments import INT32_MAX

LANE_LIMIT = 32  # moe_ep/limits.hpp kMaxTopk: the routed experts of one token
DOMAIN_VARIABLE = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"
_CHUNK_VARIABLES = {"num_of_tokens_per_chunk_dispatch_api": "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API",
                    "num_of_tokens_per_chunk_combine_api": "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API",
                    "num_of_tokens_per_chunk_preprocessing_api": "NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API"}


def serialised(method):
    """Runs a HybridEPBuffer method under the buffer's call lock (``self._calls``, an RLock): the
    calls of one buffer are serialised, as those of moe-ep's C++ buffers are (docs/semantics.md,
    "Concurrent calls")."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._calls:
            return method(self, *args, **kwargs)
    return call


def align(x, p):
    return (x + p - 1) // p * p


def capacity_of(num_tokens):
    """T = a(max(num_tokens, 512), 64): the token capacity per rank the buffers are sized for."""
    return align(max(num_tokens, 512), 64)


class HybridEpConfigInstance:
    """The shape and knobs of one HybridEP call. GPU-only knobs (block counts, chunk sizes) are
    recorded and have no effect on CPU.

    Arguments:
        values: keyword values of its fields (``hidden_dim``, ``max_num_of_tokens_per_rank``,
            ``num_of_experts_per_rank``, ``num_of_ranks_per_node``, ``num_of_nodes``,
            ``pad_multiple``, ``use_fp8``, ``fuse_permute_dispatch``, the block counts and chunk
            sizes); the others keep their defaults. An unknown field is an ``InvalidArgument``.
    """

    _FIELDS = dict(hidden_dim=0, max_num_of_tokens_per_rank=0, num_of_experts_per_rank=0, num_of_ranks_per_node=1,
                   num_of_nodes=1, pad_multiple=1, use_fp8=False, fuse_permute_dispatch=False,
                   num_of_blocks_dispatch_api=24, num_of_blocks_combine_api=24, num_of_blocks_preprocessing_api=108,
                   num_of_blocks_permute=None, num_of_blocks_unpermute=None,
                   num_of_tokens_per_chunk_dispatch_api=64, num_of_tokens_per_chunk_combine_api=64,
                   num_of_tokens_per_chunk_preprocessing_api=64)

    def __init__(self, **values):
        for name, default in self._FIELDS.items():
            setattr(self, name, default)
        self.update(values)

    def update(self, values):
        """Sets fields.

        Arguments:
            values: a dict of field names to values (an unknown name is an ``InvalidArgument``).

        Returns:
            self: this configuration.
        """
        for name, value in values.items():
            if name not in self._FIELDS:
                raise _C.InvalidArgument(f"HybridEpConfigInstance has no field {name!r} (fields: "
                                         f"{', '.join(self._FIELDS)})")
            setattr(self, name, value)
        return self

    def copy(self):
        """A new configuration with the same fields.

        Returns:
            config: a ``HybridEpConfigInstance``.
        """
        return HybridEpConfigInstance(**{name: getattr(self, name) for name in self._FIELDS})

    def validity_problems(self):
        """What breaks HybridEP's validity rules (docs/hybrid-ep.md).

        Returns:
            problems: a list of str, phrases naming the values (empty when valid).
        """
        problems = []
        h, el, nodes = self.hidden_dim, self.num_of_experts_per_rank, self.num_of_nodes
        multiple = 512 if self.use_fp8 else 16
        if h % multiple:
            problems.append(f"hidden_dim = {h} is not a multiple of {multiple} ({'FP8' if self.use_fp8 else 'BF16'})")
        if (el * self.num_of_ranks_per_node) % 4:
            problems.append(f"num_local_experts * ranks per NVLink domain = {el} * {self.num_of_ranks_per_node} is "
                            f"not a multiple of 4")
        t = self.max_num_of_tokens_per_rank
        if t > INT32_MAX:
            problems.append(f"T = {t} tokens per rank (max_num_of_tokens_per_rank rounded up) is out of range (must "
                            f"be at most {INT32_MAX})")
        if nodes > 1 and 3 * t + 1 >= 65536:
            problems.append(f"with {nodes} NVLink domains, 3 * T + 1 = {3 * t + 1} (T = {t} tokens per rank) must be "
                            f"below 65536")
        return problems

    def is_valid(self):
        """Whether the configuration keeps HybridEP's validity rules.

        Returns:
            valid: bool, True when ``validity_problems()`` is empty.
        """
        return not self.validity_problems()

    def __repr__(self):
        return "HybridEpConfigInstance(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self._FIELDS) + ")"


def chunk_sizes_from_environment():
    """The GPU chunk sizes of the environment (recorded only), default 64."""
    out = {}
    for field, variable in _CHUNK_VARIABLES.items():
        text = os.environ.get(variable)
        try:
            out[field] = int(text) if text else 64
        except ValueError:
            out[field] = 64
    return out


def nvlink_domain_size(group, rank):
    """L: the group's ranks per node, or NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN when set. Returns
    (L, problem): a value other than the physical grouping is a problem (moe-ep's per-node
    reduction order follows the physical nodes)."""
    physical = group.num_scaleup
    text = os.environ.get(DOMAIN_VARIABLE)
    if text is None or text.strip() == "":
        return physical, None
    try:
        value = int(text)
    except ValueError:
        return physical, f"{DOMAIN_VARIABLE} = {text!r} is not an integer"
    if value != physical:
        return physical, (f"{DOMAIN_VARIABLE} = {value} differs from the {physical} ranks per node of the group: moe-ep "
                          f"groups ranks into NVLink domains as the transport's nodes are, so the variable must be "
                          f"{physical} or unset")
    return value, None


def check_int(name, value, low=None, allow_none=False):
    """A problem phrase when value is not an int (bool excluded) in [low, 2**31 - 1], else None."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{name} = {value!r} is not an integer"
    if low is not None and value < low:
        return f"{name} = {value} is below {low}"
    if value > INT32_MAX:
        return f"{name} = {value} is out of range (must be at most {INT32_MAX})"
    return None


def agree(group, context, problem, payload=b""):
    """Collective: every rank's payload, by rank. A rank with a problem raises InvalidArgument (or
    the exception given) here and its peers raise PeerError naming it, so no rank goes on alone."""
    mine = pickle.dumps((None if problem is None else str(problem), payload))
    blocks = [pickle.loads(b) for b in group.all_gather_bytes(mine)]
    bad = [r for r, (p, _) in enumerate(blocks) if p is not None]
    if problem is not None:
        raise problem if isinstance(problem, BaseException) else _C.InvalidArgument(str(problem))
    if bad:
        error = _C.PeerError(f"{context}: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} refused the "
                             f"call: {blocks[bad[0]][0]}")
        error.ranks = bad
        raise error
    return [p for _, p in blocks]
