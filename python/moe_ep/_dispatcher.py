"""The token dispatcher from Python (docs/dispatcher.md): probe, V2 opt-in, buffer lifecycle,
mode per batch, split dispatch/combine halves, hooks; outputs as torch tensors."""

from . import _C
from ._arguments import int32, optional_int32
from ._groups import resolve_group


def probe_providers(path_list=""):
    """Which generations the providers of ``path_list`` offer (colon-separated library paths;
    "cpu" = built in; empty = "cpu"). A dict: path_list, providers, v1, v2 (each with available,
    provider, origin, reason). Never raises."""
    return _C.probe_providers(path_list)


def env():
    """Every environment variable moe-ep reads: name, type, default, accepted, doc, value, source
    (and error, when the current value is invalid)."""
    return _C.env_registry()


class BufferCache:
    """Owns at most one buffer per group, shared by every TokenDispatcher on it. Collective."""

    def __init__(self, group):
        self.group = group
        self._native = _C.BufferCache(resolve_group(group))

    def destroy(self):
        self._native.destroy()

    def stats(self):
        return self._native.stats()


class DispatchOutput(dict):
    """A dispatch's outputs; keys are also attributes (format, generation, mode, provider,
    micro_batch, hidden_states, hidden_states_scale, topk_ids, topk_weights,
    num_recv_tokens_per_expert, masked_m, expected_m)."""

    __getattr__ = dict.__getitem__


def _normal_layout(layout, expanded):
    """V2 normal-mode layout: ``v2_normal_layout`` ("compact", "expanded" or "hybrid_ep"), or the
    older switch ``v2_expanded_normal_layout`` (True: "expanded", False: "compact"); not both."""
    if expanded is None:
        return layout
    if layout is not None:
        raise ValueError("give v2_normal_layout or v2_expanded_normal_layout, not both")
    return "expanded" if expanded else "compact"


class TokenDispatcher:
    """One MoE layer's dispatcher. Unset options take their environment variables
    (MOE_EP_USE_V2, MOE_EP_MODE, ...). ``kind`` is "prefill" (or "extend") or "decode"."""

    def __init__(self, cache, hidden, num_experts, num_topk, use_v2=None, mode=None,
                 num_max_dispatch_tokens_per_rank=None, num_max_prefill_tokens_per_rank=None, dispatch_dtype=None,
                 num_workers=None, allow_hybrid_mode=None, allow_multiple_reduction=None,
                 v2_expanded_normal_layout=None, timeout_secs=None, provider_path=None, round_scale=False,
                 use_ue8m0=False, expert_alignment=1, nvfp4_global_scale=1.0, nvfp4_use_ue8m0=False,
                 v2_normal_layout=None):
        if not isinstance(cache, BufferCache):
            raise TypeError(f"cache must be a moe_ep.BufferCache, not {type(cache).__name__}")
        self.cache = cache
        layout = _normal_layout(v2_normal_layout, v2_expanded_normal_layout)
        self._native = _C.TokenDispatcher(cache._native, int32(hidden, "hidden"), int32(num_experts, "num_experts"),
                                          int32(num_topk, "num_topk"), use_v2, mode,
                                          optional_int32(num_max_dispatch_tokens_per_rank,
                                                         "num_max_dispatch_tokens_per_rank"),
                                          optional_int32(num_max_prefill_tokens_per_rank,
                                                         "num_max_prefill_tokens_per_rank"),
                                          dispatch_dtype, optional_int32(num_workers, "num_workers"),
                                          allow_hybrid_mode, allow_multiple_reduction, layout, timeout_secs,
                                          provider_path, round_scale, use_ue8m0,
                                          int32(expert_alignment, "expert_alignment"), nvfp4_global_scale,
                                          nvfp4_use_ue8m0)

    @property
    def generation(self):
        return self._native.generation

    @property
    def mode(self):
        return self._native.mode

    def resolve(self, kind):
        return self._native.resolve(kind)

    def options(self):
        return self._native.options()

    def add_hook(self, point, hook):
        """point: "after_dispatch_a" or "after_combine_a"; hook(info) gets point, micro_batch, mode."""
        self._native.add_hook(point, hook)

    def dispatch_a(self, hidden_states, topk_idx, topk_weights, kind="prefill", micro_batch=0):
        self._native.dispatch_a(hidden_states, topk_idx, topk_weights, kind, int32(micro_batch, "micro_batch"))

    def dispatch_b(self, micro_batch=0):
        return DispatchOutput(self._native.dispatch_b(int32(micro_batch, "micro_batch")))

    def dispatch(self, hidden_states, topk_idx, topk_weights, kind="prefill", micro_batch=0):
        """dispatch_a, the "after_dispatch_a" hooks, dispatch_b."""
        return DispatchOutput(self._native.dispatch(hidden_states, topk_idx, topk_weights, kind,
                                                    int32(micro_batch, "micro_batch")))

    def combine_a(self, hidden_states, micro_batch=0):
        self._native.combine_a(hidden_states, int32(micro_batch, "micro_batch"))

    def combine_b(self, micro_batch=0):
        return self._native.combine_b(int32(micro_batch, "micro_batch"))

    def combine(self, hidden_states, micro_batch=0):
        """combine_a, the "after_combine_a" hooks, combine_b."""
        return self._native.combine(hidden_states, int32(micro_batch, "micro_batch"))
