"""``HybridEPBuffer``: NVIDIA HybridEP's API (DeepEP's ``hybrid-ep`` branch) on moe-ep's V2 engine,
for CPU tensors, with the reference's rows, layouts, handles and reduction bits (docs/hybrid-ep.md).

Every call runs on an internal V2 ``ElasticBuffer`` of the same group (hybrid mode, multiple
reduction). The routing input becomes per-token lanes: the routed experts ordered by (node key,
expert), node key 0 for the token's own NVLink domain, then domains n-1, n-2, ... . moe-ep sums a
token's units in ascending master-lane order, so combine adds the own domain's ranks ascending,
then each other domain as one BF16 unit, as HybridEP does; combine asks the engine to keep the own
domain's ranks as separate terms (``own_node_rank_terms``).

Argument errors raise ``moe_ep.InvalidArgument`` (a RuntimeError) naming the argument and value,
on the rank that passed it; its peers raise ``moe_ep.PeerError`` naming it.

The calls of one buffer are serialised (an RLock held for each whole call, its agreement, any
regrowth of the internal buffer and the V2 calls): threads of a rank may share it, and ranks pair
their calls in the order each rank's threads got it (docs/semantics.md, "Concurrent calls").
"""

import threading
import types

import torch

from .. import _C
from .buffers._common import group_of
from ._hybrid_ep_config import (HybridEpConfigInstance, agree, align, capacity_of, check_int,
                                chunk_sizes_from_environment, nvlink_domain_size, serialised)
from ._hybrid_ep_permute import PermuteMixin
from ._hybrid_ep_routing import (HybridEPShape, HybridHandle, Routing, check_tensor, lane_values, routed_count_problem,
                                 routing_of, scatter_lanes)

_FP8_DTYPES = (torch.uint8, torch.float8_e4m3fn)


class _Configurer:
    """Holds the template configuration every call starts from."""

    def __init__(self, template):
        self.template_config = template


class HybridEPBuffer(PermuteMixin):
    """NVIDIA HybridEP's buffer (DeepEP's ``hybrid-ep`` branch) on moe-ep's V2 engine, for CPU
    tensors, with HybridEP's rows, layouts, handles and reduction bits (docs/hybrid-ep.md).
    Construction, the dispatches and the combines are collective; the calls of one buffer are
    serialised.

    Arguments:
        group: a ``torch.distributed.ProcessGroup``, an mpi4py communicator or a ``moe_ep.Group``.
        hidden_dim: int >= 1, the hidden size ``H`` (a multiple of 16, of 512 with ``use_fp8``).
        max_num_of_tokens_per_rank: int >= 0: the buffer is sized for
            ``T = a(max(max_num_of_tokens_per_rank, 512), 64)`` tokens per rank, and grows when a
            call needs more.
        num_local_experts: int >= 1, the experts of each rank (``El``; ``El * L`` a multiple of 4).
        use_fp8: bool, default False: the calls' default payload is FP8 with scales.
        num_sms_dispatch_api: int >= 1 or None: a GPU block count, recorded; no effect.
        num_sms_combine_api: int >= 1 or None: recorded; no effect.
        num_sms_preprocessing_api: int >= 1 or None: recorded; no effect.
        num_blocks_permute: int >= 1 or None: recorded; no effect.
        num_blocks_unpermute: int >= 1 or None: recorded; no effect.
        load_cached_kernels: bool, default False: GPU kernel cache; no effect.
        use_shared_buffer: bool, default True: GPU receive buffers; no effect.
        enable_custom_allgather: bool, default False: GPU all-gather; no effect.
        num_of_hybrid_ep_ranks_per_nvlink_domain: deprecated in the reference, ignored (``L`` is
            the group's ranks per node; ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` may restate it).
        use_mnnvl: deprecated in the reference, ignored.
    """

    # Long: the constructor's argument list and checks are the reference's, one statement each.
    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, use_fp8=False,
                 num_sms_dispatch_api=None, num_sms_combine_api=None, num_sms_preprocessing_api=None,
                 num_blocks_permute=None, num_blocks_unpermute=None, load_cached_kernels=False, use_shared_buffer=True,
                 enable_custom_allgather=False, num_of_hybrid_ep_ranks_per_nvlink_domain=None, use_mnnvl=None):
        self.group = group
        self._calls = threading.RLock()  # serialises the calls of this buffer (@serialised)
        self._group = group_of(group, None)
        self.rank, self.group_size = self._group.rank(), self._group.size()
        domain, problem = nvlink_domain_size(self._group, self.rank)
        problems = [problem] if problem else []
        self.num_of_hybrid_ep_ranks_per_nvlink_domain = domain
        self.local_rank, self.node_rank = self.rank % domain, self.rank // domain
        self.num_of_nodes = self.group_size // domain
        for name, value, low, none in (("hidden_dim", hidden_dim, 1, False),
                                       ("max_num_of_tokens_per_rank", max_num_of_tokens_per_rank, 0, False),
                                       ("num_local_experts", num_local_experts, 1, False),
                                       ("num_sms_dispatch_api", num_sms_dispatch_api, 1, True),
                                       ("num_sms_combine_api", num_sms_combine_api, 1, True),
                                       ("num_sms_preprocessing_api", num_sms_preprocessing_api, 1, True),
                                       ("num_blocks_permute", num_blocks_permute, 1, True),
                                       ("num_blocks_unpermute", num_blocks_unpermute, 1, True)):
            p = check_int(name, value, low, none)
            if p:
                problems.append(p)
        self.use_fp8 = bool(use_fp8)
        # GPU-only: SM and block counts, the kernel cache, the shared receive buffers, the custom
        # all-gather. Recorded; moe-ep's CPU path has no counterpart (num_of_hybrid_ep_ranks_per_
        # nvlink_domain and use_mnnvl are deprecated in the reference and ignored).
        self.load_cached_kernels, self.use_shared_buffer = bool(load_cached_kernels), bool(use_shared_buffer)
        self.enable_custom_allgather = bool(enable_custom_allgather)
        sms = 24 if self.num_of_nodes == 1 else 8
        template = HybridEpConfigInstance(
            num_of_ranks_per_node=domain, num_of_nodes=self.num_of_nodes, use_fp8=self.use_fp8,
            num_of_blocks_dispatch_api=num_sms_dispatch_api or sms, num_of_blocks_combine_api=num_sms_combine_api or sms,
            num_of_blocks_preprocessing_api=num_sms_preprocessing_api or 108, num_of_blocks_permute=num_blocks_permute,
            num_of_blocks_unpermute=num_blocks_unpermute, **chunk_sizes_from_environment())
        if not problems:
            template.update(dict(hidden_dim=hidden_dim, num_of_experts_per_rank=num_local_experts,
                                 max_num_of_tokens_per_rank=capacity_of(max_num_of_tokens_per_rank)))
            problems += template.validity_problems()
        self.configurer = _Configurer(template)
        self.num_local_experts = num_local_experts
        self.hidden_dim = hidden_dim
        self._retired = []  # runtimes replaced by a larger one (handles may still use them)
        refusal = (f"[rank {self.rank}] HybridEPBuffer: The buffer config is not valid: " + "; ".join(problems)
                   if problems else "")
        self.runtime = self._make_runtime(template.max_num_of_tokens_per_rank, hidden_dim, refusal)

    def _make_runtime(self, capacity, hidden, refusal=""):
        """Collective: the internal V2 buffer for `capacity` tokens per rank of `hidden` columns."""
        num_bytes = 0
        k = min(32, self.num_local_experts * self.group_size) if not refusal else 0
        if not refusal:
            num_bytes = _C.ElasticBuffer.get_buffer_size_hint(self._group, capacity, hidden, k, False, True, True)
        self._capacity, self._sized_hidden = capacity, hidden
        # A refused configuration's capacity may fit no int; the refusal is all the buffer needs.
        return _C.ElasticBuffer(self._group, num_bytes, 0 if refusal else capacity, 0, k, False, True, True, True, True, 0, 300.0, False,
                                False, -1, "HybridEPBuffer moves host tensors", refusal, "")

    def _grow(self, num_tokens, hidden):
        """Collective (every rank decides alike from the agreed shape): a larger internal buffer
        when a(N, 16) exceeds the capacity or the rows are wider than it was sized for."""
        if align(num_tokens, 16) <= self._capacity and hidden <= self._sized_hidden:
            return
        self._retired.append(self.runtime)
        self.runtime = self._make_runtime(max(self._capacity, capacity_of(num_tokens)), max(hidden, self._sized_hidden))

    def _context(self, op):
        return f"[rank {self.rank}] HybridEPBuffer.{op}"

    def _refusal(self, op, error):
        """What this rank raises for an argument its checks refused: InvalidArgument naming the
        call for a ValueError, any other error as it is (its peers learn it through the call)."""
        if isinstance(error, ValueError) and not isinstance(error, _C.Error):
            return _C.InvalidArgument(f"{self._context(op)}: {error}")
        return error

    @serialised
    def empty_jit_cache(self):
        """Empties HybridEP's GPU kernel cache: nothing to do on CPU."""

    @serialised
    def update_template_config(self, hidden_dim=None, num_of_tokens_per_rank=None, num_local_experts=None,
                               pad_multiple=None, use_fp8=None, fuse_permute_dispatch=False, **kwargs):
        """The configuration of a call: the template with these overrides, checked
        (``moe_ep.InvalidArgument`` naming the values when it breaks a validity rule).

        Arguments:
            hidden_dim: int or None (the template's).
            num_of_tokens_per_rank: int or None: the capacity ``a(max(n, 512), 64)``, at least the
                template's.
            num_local_experts: int or None (the template's).
            pad_multiple: int or None (1): the expert alignment of the permuted layout.
            use_fp8: bool or None (the template's).
            fuse_permute_dispatch: bool, default False; recorded.
            kwargs: other fields of ``HybridEpConfigInstance`` to set (an unknown one is an
                ``InvalidArgument``).

        Returns:
            config: a ``HybridEpConfigInstance``.
        """
        config, problems = self._call_config(hidden_dim, num_of_tokens_per_rank, num_local_experts, pad_multiple,
                                             use_fp8, fuse_permute_dispatch, kwargs)
        if problems:
            raise _C.InvalidArgument(f"{self._context('update_template_config')}: The buffer config is not valid: "
                                     + "; ".join(problems))
        return config

    def _call_config(self, hidden_dim, num_tokens, num_local_experts, pad_multiple, use_fp8, fuse, kwargs):
        config = self.configurer.template_config.copy()
        values = dict(kwargs)
        values.update(hidden_dim=config.hidden_dim if hidden_dim is None else hidden_dim,
                      num_of_experts_per_rank=config.num_of_experts_per_rank if num_local_experts is None
                      else num_local_experts,
                      pad_multiple=pad_multiple or 1, use_fp8=config.use_fp8 if use_fp8 is None else bool(use_fp8),
                      fuse_permute_dispatch=bool(fuse))
        if num_tokens is not None:
            values["max_num_of_tokens_per_rank"] = max(config.max_num_of_tokens_per_rank, capacity_of(num_tokens))
        config.update(values)
        return config, config.validity_problems()

    # ---- the shared steps of the calls ----

    def _payload(self, hidden, scaling_factor, use_fp8):
        """(x for the V2 dispatch, N, H, FP8?): hidden BF16, or 1-byte with scaling_factor when FP8."""
        fp8 = self.use_fp8 if use_fp8 is None else bool(use_fp8)
        dtypes = (torch.bfloat16,) + (_FP8_DTYPES if fp8 else ())
        check_tensor("hidden", hidden, dtypes, (-1, -1))
        if not hidden.is_contiguous():
            raise ValueError(f"hidden (shape {list(hidden.shape)}, strides {hidden.stride()}) is not contiguous")
        n, h = hidden.shape
        if hidden.dtype == torch.bfloat16:
            return hidden, n, h, False
        if h % 128:
            raise ValueError(f"hidden has {h} columns; FP8 rows need a multiple of 128 (one scale per 128)")
        if scaling_factor is None:
            raise ValueError(f"scaling_factor is None; FP8 hidden ({hidden.dtype}) needs float32 [{n}, {h // 128}]")
        check_tensor("scaling_factor", scaling_factor, (torch.float32,), (n, h // 128))
        return (hidden.view(torch.float8_e4m3fn), scaling_factor), n, h, True

    def _agree_shape(self, op, blocks):
        """Every rank's (N, H) must be rank 0's (HybridEP all-gathers equal-sized maps)."""
        for what, index in (("tokens (hidden rows)", 0), ("hidden columns", 1)):
            values = [b[index] for b in blocks]
            bad = [r for r, v in enumerate(values) if v != values[0]]
            if not bad:
                continue
            text = (f"hidden has {values[self.rank]} {what} here and {values[0]} on rank 0; HybridEP needs the same on "
                    f"every rank (per rank: {values})")
            if self.rank in bad:
                raise _C.InvalidArgument(f"{self._context(op)}: {text}")
            error = _C.PeerError(f"{self._context(op)}: ranks {bad} disagree with rank 0: {text}")
            error.ranks = bad
            raise error

    def _routed_call(self, op, hidden, scaling_factor, use_fp8, routing_args, pad_multiple=None, more=None):
        """Collective, for calls without a handle: checks every rank's arguments, all-gathers the
        routing maps, and returns the call's routing (a namespace)."""
        el, g = self.num_local_experts, self.group_size
        problem, payload = None, None
        try:
            x, n, h, fp8 = self._payload(hidden, scaling_factor, use_fp8)
            routed, probs = routing_of(n, el * g, **routing_args)
            config, problems = self._call_config(h, n, el, pad_multiple, fp8, False, {})
            if problems:
                raise ValueError("The buffer config is not valid: " + "; ".join(problems))
            phrase = routed_count_problem(routed) or (more() if more else None)
            if phrase:
                raise ValueError(phrase)
            payload = (n, h, routed)
        except Exception as e:  # every refusal must reach the agreement, or the peers would wait
            problem = self._refusal(op, e)
        blocks = agree(self._group, self._context(op), problem, payload)
        self._agree_shape(op, blocks)
        self._grow(n, h)
        shape = HybridEPShape(g, self.num_of_hybrid_ep_ranks_per_nvlink_domain, el, n)
        routing = Routing(torch.cat([b[2] for b in blocks]), shape, self.rank)
        mine = torch.arange(self.rank * n, (self.rank + 1) * n)
        lanes = routing.lanes_for(mine)
        weights = lane_values(probs, lanes) if probs is not None else None
        return types.SimpleNamespace(x=x, fp8=fp8, dtype=hidden.dtype, n=n, routing=routing, lanes=lanes,
                                     weights=weights, config=config, runtime=self.runtime, shape=shape)

    @staticmethod
    def _v2_dispatch(runtime, x, lanes, weights, num_experts, capacity, expand, alignment, native=None):
        """(recv_x, recv_sf, recv_weights, native handle) of the internal V2 dispatch."""
        cached = native is not None
        recv_x, recv_sf, _, recv_w, new_native, _ = runtime.dispatch(
            x, None if cached else lanes, weights, None, 0 if cached else num_experts, 0 if cached else capacity,
            alignment, 0, 0, None, None, False, False, native, True, None if cached else True, expand, expand,
            False, 0)
        return recv_x, recv_sf, recv_w, native if cached else new_native

    # ---- dispatch and combine (compact) ----

    @serialised
    def dispatch(self, hidden, scaling_factor=None, topk_idx=None, topk_weights=None, num_of_experts=None, probs=None,
                 routing_map=None, num_dispatched_tokens_tensor=None, num_dispatched_tokens=None, handle=None):
        """Collective: sends every token to each rank with one of its experts; rows in ascending
        global token id (docs/hybrid-ep.md, "dispatch"). Give ``routing_map`` (with ``probs``) or
        ``topk_idx`` (with ``topk_weights``); with ``handle``, neither.

        Arguments:
            hidden: `torch.Tensor` ``[N, H]`` contiguous bfloat16, or with ``use_fp8`` uint8 /
                float8_e4m3fn; ``N`` the same on every rank.
            scaling_factor: `torch.Tensor` ``[N, H / 128]`` float32 for an FP8 ``hidden``, else None.
            topk_idx: `torch.Tensor` ``[N, k]`` of an integer dtype, ids in ``[-1, E)``, or None.
            topk_weights: `torch.Tensor` ``[N, k]`` float32, or None.
            num_of_experts: int, ``E`` (must be ``El * num_ranks``), or None.
            probs: `torch.Tensor` ``[N, E]`` float32, or None.
            routing_map: `torch.Tensor` ``[N, E]`` bool, or None.
            num_dispatched_tokens_tensor: accepted, unused.
            num_dispatched_tokens: accepted, unused.
            handle: the 7-tuple of an earlier ``dispatch`` (no routing work), or None.

        Returns:
            tokens: `torch.Tensor` ``[D, H]`` of ``hidden``'s dtype.
            probs: `torch.Tensor` ``[D, El * L]`` float32 (this NVLink domain's experts), or None.
            scaling_factor: `torch.Tensor` ``[D, H / 128]`` float32 (FP8), or None.
            handle: the 7-tuple (docs/hybrid-ep.md), or the given one.
        """
        if handle is not None:
            return self._cached_dispatch(hidden, scaling_factor, probs, handle)
        call = self._routed_call("dispatch", hidden, scaling_factor, None,
                                 dict(topk_idx=topk_idx, topk_weights=topk_weights, num_of_experts=num_of_experts,
                                      routing_map=routing_map, probs=probs))
        routing, shape = call.routing, call.shape
        recv_x, recv_sf, recv_w, native = self._v2_dispatch(call.runtime, call.x, call.lanes, call.weights, shape.experts,
                                                            self._capacity, False, 1)
        recv_lanes = routing.lanes_for(routing.recv)
        state = types.SimpleNamespace(kind="dispatch", runtime=call.runtime, native=native, lanes=call.lanes,
                                      recv_lanes=recv_lanes, n=call.n, shape=shape)
        items = routing.common_items() + [call.n, call.config]
        return (recv_x.view(call.dtype), self._node_slice(recv_w, recv_lanes), recv_sf if call.fp8 else None,
                HybridHandle(items, state))

    def _node_slice(self, recv_w, recv_lanes):
        """probs [D, El*L]: the received weight rows at this NVLink domain's experts."""
        if recv_w is None:
            return None
        width = self.num_local_experts * self.num_of_hybrid_ep_ranks_per_nvlink_domain
        return scatter_lanes(recv_w, recv_lanes, width, self.node_rank * width)

    def _handle_state(self, handle, kind, op):
        state = getattr(handle, "_hybrid", None)
        if state is None or state.kind != kind:
            what = "the 7-tuple dispatch returned" if kind == "dispatch" else "the 11-tuple dispatch_with_permute returned"
            got = "None" if handle is None else f"a {type(handle).__name__}"
            if isinstance(handle, tuple):
                got += f" of {len(handle)} items"
            raise ValueError(f"handle is {got}; {op} needs {what}")
        return state

    def _cached_dispatch(self, hidden, scaling_factor, probs, handle):
        problem, state = None, None
        try:
            state = self._handle_state(handle, "dispatch", "dispatch")
            x, n, _, fp8 = self._payload(hidden, scaling_factor, None)
            if n != state.n:
                raise ValueError(f"hidden has {n} rows, the handle's dispatch had {state.n}")
            weights = None
            if probs is not None:
                weights = lane_values(check_tensor("probs", probs, (torch.float32,), (n, state.shape.experts)),
                                      state.lanes)
        except Exception as e:  # every refusal must reach the agreement, or the peers would wait
            problem = self._refusal("dispatch", e)
        agree(self._group, self._context("dispatch"), problem)
        recv_x, recv_sf, recv_w, _ = self._v2_dispatch(state.runtime, x, None, weights, 0, 0, False, 0, state.native)
        d = state.recv_lanes.shape[0]
        recv_w = recv_w[:d] if recv_w is not None else None
        return (recv_x[:d].view(hidden.dtype), self._node_slice(recv_w, state.recv_lanes),
                recv_sf[:d] if fp8 else None, handle)

    def _combine(self, op, state, hidden, weights, problem, sum_weights):
        """The internal V2 combine (collective); normalised so that a zero sum is +0, as HybridEP's
        accumulator (starting at +0.0) gives it."""
        runtime = state.runtime if state is not None else self.runtime
        if problem is not None:  # the peers learn it through the combine's agreement
            try:
                runtime._combine_hybrid_ep(None, None, None, sum_weights, True, f"{type(problem).__name__}: {problem}")
            except _C.Error:
                pass
            raise problem
        combined, combined_w = runtime._combine_hybrid_ep(hidden, state.native, weights, sum_weights, True, "")
        combined = combined + 0.0
        if combined_w is None:
            return combined, None
        return combined, scatter_lanes(combined_w, state.lanes, state.shape.experts) + 0.0

    @serialised
    def combine(self, hidden, probs=None, handle=None):
        """Collective: returns to every token the sum of the rows of the ranks that received it, in
        HybridEP's order (docs/hybrid-ep.md, "Reduction"); no weights are applied.

        Arguments:
            hidden: `torch.Tensor` ``[D, H]`` bfloat16, contiguous, in the dispatch's row order.
            probs: `torch.Tensor` ``[D, El * L]`` float32, or None (or a tensor of 0 elements).
            handle: the 7-tuple of the ``dispatch``.

        Returns:
            combined: `torch.Tensor` ``[N, H]`` bfloat16.
            combined_probs: `torch.Tensor` ``[N, E]`` float32, or None without ``probs``.
        """
        problem, state, weights = None, None, None
        try:
            state = self._handle_state(handle, "dispatch", "combine")
            d, width = state.recv_lanes.shape[0], self.num_local_experts * self.num_of_hybrid_ep_ranks_per_nvlink_domain
            check_tensor("hidden", hidden, (torch.bfloat16,), (d, -1))
            if not hidden.is_contiguous():
                raise ValueError(f"hidden (strides {hidden.stride()}) is not contiguous")
            if probs is not None and (not isinstance(probs, torch.Tensor) or probs.numel() != 0):
                check_tensor("probs", probs, (torch.float32,), (d, width))
                base = self.node_rank * width
                weights = lane_values(torch.cat([torch.zeros(d, base), probs,
                                                 torch.zeros(d, state.shape.experts - base - width)], 1),
                                      state.recv_lanes)
        except Exception as e:  # every refusal must reach the agreement, or the peers would wait
            problem = self._refusal("combine", e)
        return self._combine("combine", state, hidden, weights, problem, True)
