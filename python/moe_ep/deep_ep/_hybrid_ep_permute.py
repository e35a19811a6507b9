"""HybridEPBuffer's permuted calls (docs/hybrid-ep.md): ``dispatch_with_permute`` on moe-ep's V2
expanded layout (expert blocks at P_e = sum of pad(c_j) for j < e, rows in ascending source id,
zero padding rows) fitted to ``num_permuted_tokens``, and ``combine_with_unpermute``."""

import types

import torch

from .. import _C
from ._hybrid_ep_config import agree, check_int, serialised
from ._hybrid_ep_routing import HybridHandle, check_tensor, lane_values


def pad_of(pad_multiple):
    """The expert alignment: pad_multiple when > 0, else 1 (no padding)."""
    return pad_multiple if pad_multiple else 1


def budget_of(num_permuted_tokens):
    """num_permuted_tokens as an int (an int or a 0-d integer tensor), or None."""
    if isinstance(num_permuted_tokens, torch.Tensor):
        return int(num_permuted_tokens)
    return num_permuted_tokens


def fit(t, rows, valid):
    """t's first `valid` rows in a tensor of `rows` rows (t itself when that is all of it), zero
    after them."""
    if t is None:
        return None
    if t.shape[0] >= rows and valid >= rows:
        return t[:rows]
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype)
    m = min(rows, valid, t.shape[0])
    out[:m] = t[:m]
    return out


def _budget_problem(num_permuted_tokens, pad_multiple, non_blocking, num_of_experts_per_rank, local_experts):
    """A phrase naming a bad budget argument, or None."""
    problem = check_int("pad_multiple", pad_multiple, 0, True)
    if problem:
        return problem
    if isinstance(num_permuted_tokens, torch.Tensor) and (num_permuted_tokens.dim() != 0 or
                                                          num_permuted_tokens.dtype.is_floating_point):
        return (f"num_permuted_tokens is a {num_permuted_tokens.dtype} tensor of shape "
                f"{list(num_permuted_tokens.shape)}; expected an int or a 0-d integer tensor")
    problem = check_int("num_permuted_tokens", num_permuted_tokens, 0, True)
    if problem:
        return problem
    if num_of_experts_per_rank is not None and num_of_experts_per_rank != local_experts:
        return f"num_of_experts_per_rank = {num_of_experts_per_rank!r}, the buffer has {local_experts} local experts"
    budget = budget_of(num_permuted_tokens)
    if non_blocking and budget is None:
        return "non_blocking=True needs num_permuted_tokens (the rows to allocate)"
    if non_blocking and pad_multiple and budget % pad_multiple:
        return f"num_permuted_tokens = {budget} is not a multiple of pad_multiple = {pad_multiple} (non_blocking)"
    return None


def _too_small(context, budget, needed):
    return _C.InvalidArgument(f"{context}: num_permuted_tokens = {budget} is smaller than the {needed} rows this rank "
                              f"receives (the sum of the padded expert counts); pass at least {needed}, None, or "
                              f"non_blocking=True to drop the pairs past it")


class PermuteMixin:
    """dispatch_with_permute and combine_with_unpermute of HybridEPBuffer."""

    # Long: the reference's keyword list, then the steps of the uncached call one statement each.
    @serialised
    def dispatch_with_permute(self, *, hidden, topk_idx=None, topk_weights=None, num_of_experts_per_rank=None,
                              num_of_experts=None, use_fp8=None, routing_map=None, probs=None, scaling_factor=None,
                              num_permuted_tokens=None, pad_multiple=None, handle=None, non_blocking=False,
                              fuse_permute_dispatch=False, num_dispatched_tokens=None, use_host_meta=None):
        """Collective: ``dispatch`` into the permuted layout, one row per (token, local expert), each
        expert's block padded to ``pad_multiple`` (docs/hybrid-ep.md, "dispatch_with_permute").
        Keyword-only.

        Arguments:
            hidden: `torch.Tensor` ``[N, H]`` contiguous, bfloat16 or (FP8) uint8 / float8_e4m3fn.
            topk_idx: `torch.Tensor` ``[N, k]`` of an integer dtype, ids in ``[-1, E)``, or None.
            topk_weights: `torch.Tensor` ``[N, k]`` float32, or None.
            num_of_experts_per_rank: int or None; when given, must be ``El``.
            num_of_experts: int, ``E``, or None.
            use_fp8: bool or None (the buffer's).
            routing_map: `torch.Tensor` ``[N, E]`` bool, or None.
            probs: `torch.Tensor` ``[N, E]`` float32, or None.
            scaling_factor: `torch.Tensor` ``[N, H / 128]`` float32 for an FP8 ``hidden``, else None.
            num_permuted_tokens: int or 0-d integer tensor >= 0, or None: the rows returned (None:
                exactly the padded rows); required with ``handle`` and with ``non_blocking``.
            pad_multiple: int >= 0 or None: the expert alignment (None and 0: none).
            handle: the 11-tuple of an earlier call (no routing work), or None.
            non_blocking: bool, default False: ``num_permuted_tokens`` rows, dropping the pairs past
                them (``overflow_flag`` says so).
            fuse_permute_dispatch: bool, default False; no effect.
            num_dispatched_tokens: accepted, unused.
            use_host_meta: deprecated: when given, ``non_blocking = not use_host_meta``.

        Returns:
            tokens: `torch.Tensor` ``[rows, H]`` of ``hidden``'s dtype, padding rows zero.
            probs: `torch.Tensor` ``[rows]`` float32, or None.
            scaling_factor: `torch.Tensor` ``[rows, H / 128]`` float32 (FP8), or None.
            tokens_per_expert: `torch.Tensor` ``[El]`` int64, the padded count per expert; None with
                ``handle``.
            handle: the 11-tuple (docs/hybrid-ep.md), or the given one.
        """
        if use_host_meta is not None:
            non_blocking = not use_host_meta
        if handle is not None:
            return self._cached_permute(hidden, scaling_factor, probs, num_permuted_tokens, pad_multiple, handle,
                                        non_blocking)
        op = "dispatch_with_permute"
        call = self._routed_call(op, hidden, scaling_factor, use_fp8,
                                 dict(topk_idx=topk_idx, topk_weights=topk_weights, num_of_experts=num_of_experts,
                                      routing_map=routing_map, probs=probs), pad_multiple,
                                 lambda: _budget_problem(num_permuted_tokens, pad_multiple, non_blocking,
                                                         num_of_experts_per_rank, self.num_local_experts))
        p, routing, shape = pad_of(pad_multiple), call.routing, call.shape
        recv_x, recv_sf, recv_w, native = self._v2_dispatch(call.runtime, call.x, call.lanes, call.weights, shape.experts,
                                                            self._capacity, True, p)
        counts = routing.counts()
        padded = (counts + p - 1) // p * p
        starts = padded.cumsum(0) - padded
        total = int(padded.sum())
        budget = budget_of(num_permuted_tokens)
        rows = total if budget is None else budget
        if not non_blocking and rows < total:
            raise _too_small(self._context(op), rows, total)
        kept = torch.minimum(torch.clamp(rows - starts, min=0), counts)  # c_e less the pairs past the budget
        overflow = int(non_blocking and int(starts[-1] + counts[-1]) > rows)
        state = types.SimpleNamespace(kind="permute", runtime=call.runtime, native=native, lanes=call.lanes, n=call.n,
                                      shape=shape, pad=p, total=total, m_exp=recv_x.shape[0], kept_rows=min(rows, total),
                                      num_permuted_tokens=rows)
        items = routing.common_items() + [routing.dense_chunk_layout(), routing.dense_to_expert_map(starts, rows),
                                          kept.to(torch.int32), call.n, call.config,
                                          torch.tensor([overflow], dtype=torch.int32)]
        tokens = fit(recv_x.view(torch.uint8) if call.fp8 else recv_x, rows, total).view(call.dtype)
        tokens_per_expert = ((kept + p - 1) // p * p).to(torch.int64)
        return (tokens, fit(recv_w, rows, total), fit(recv_sf, rows, total) if call.fp8 else None, tokens_per_expert,
                HybridHandle(items, state))

    def _cached_permute(self, hidden, scaling_factor, probs, num_permuted_tokens, pad_multiple, handle, non_blocking):
        op = "dispatch_with_permute"
        problem, state = None, None
        try:
            state = self._handle_state(handle, "permute", op)
            if num_permuted_tokens is None:
                raise TypeError(f"{self._context(op)}: num_permuted_tokens is required with a handle (got None)")
            x, n, _, fp8 = self._payload(hidden, scaling_factor, None)
            if n != state.n:
                raise ValueError(f"hidden has {n} rows, the handle's dispatch had {state.n}")
            phrase = _budget_problem(num_permuted_tokens, pad_multiple, non_blocking, None, self.num_local_experts)
            if phrase is None and pad_of(pad_multiple) != state.pad:
                phrase = f"pad_multiple = {pad_multiple!r} differs from the handle's dispatch ({state.pad})"
            if phrase:
                raise ValueError(phrase)
            weights = None
            if probs is not None:
                check_tensor("probs", probs, (torch.float32,), (n, state.shape.experts))
                weights = lane_values(probs, state.lanes)
        except Exception as e:  # every refusal must reach the agreement, or the peers would wait
            problem = self._refusal(op, e)
        agree(self._group, self._context(op), problem)
        recv_x, recv_sf, recv_w, _ = self._v2_dispatch(state.runtime, x, None, weights, 0, 0, True, state.pad,
                                                       state.native)
        rows = budget_of(num_permuted_tokens)
        if not non_blocking and rows < state.kept_rows:
            raise _too_small(self._context(op), rows, state.kept_rows)
        state.num_permuted_tokens = rows
        valid = state.kept_rows  # the pairs the handle's dispatch dropped stay dropped
        tokens = fit(recv_x.view(torch.uint8) if fp8 else recv_x, rows, valid).view(hidden.dtype)
        return tokens, fit(recv_w, rows, valid), fit(recv_sf, rows, valid) if fp8 else None, None, handle

    @serialised
    def combine_with_unpermute(self, *, hidden, probs=None, handle=None, pad_multiple=None,
                               fuse_unpermute_combine=False, num_dispatched_tokens=None):
        """Collective: the inverse of ``dispatch_with_permute``: each rank sums its rows of a token
        over its local experts, then ``combine``'s order (docs/hybrid-ep.md). Keyword-only.

        Arguments:
            hidden: `torch.Tensor` bfloat16, contiguous, at least the rows the handle keeps, in the
                permuted layout.
            probs: `torch.Tensor` float32 1-D with as many rows, or None.
            handle: the 11-tuple of ``dispatch_with_permute``.
            pad_multiple: int or None; when given, must be the handle's.
            fuse_unpermute_combine: bool, default False; no effect.
            num_dispatched_tokens: accepted, unused.

        Returns:
            combined: `torch.Tensor` ``[N, H]`` bfloat16.
            combined_probs: `torch.Tensor` ``[N, E]`` float32, or None without ``probs``.
        """
        op = "combine_with_unpermute"
        problem, state, x, weights = None, None, None, None
        try:
            state = self._handle_state(handle, "permute", op)
            need = state.kept_rows
            check_tensor("hidden", hidden, (torch.bfloat16,), (-1, -1))
            if hidden.shape[0] < need or not hidden.is_contiguous():
                raise ValueError(f"hidden has shape {list(hidden.shape)} (strides {hidden.stride()}); expected a "
                                 f"contiguous tensor of at least {need} rows (the permuted rows of the handle)")
            if probs is not None:
                check_tensor("probs", probs, (torch.float32,), (-1,))
                if probs.shape[0] < need:
                    raise ValueError(f"probs has {probs.shape[0]} rows, expected at least {need}")
            if pad_multiple is not None and pad_of(pad_multiple) != state.pad:
                raise ValueError(f"pad_multiple = {pad_multiple!r} differs from the handle's dispatch ({state.pad})")
            x = fit(hidden, state.m_exp, need).contiguous()
            weights = fit(probs, state.m_exp, need) if probs is not None else None
        except Exception as e:  # every refusal must reach the agreement, or the peers would wait
            problem = self._refusal(op, e)
        return self._combine(op, state, x, weights, problem, False)
