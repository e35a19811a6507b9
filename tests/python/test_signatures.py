"""DeepEP's public Python surface (deep_ep 2.1.0, main): parameter names, order and defaults of
every public function and method, transcribed from /work/shared/reference (deepep-v1-buffer.md
§1-5, deepep-v2-elastic-buffer.md §1, deepep-python-api.md §1). Engines detect keyword support
with inspect.signature, so every parameter must be a real one (no *args / **kwargs)."""

import inspect

import pytest
import torch

import moe_ep
from moe_ep import deep_ep

REQ = object()  # a parameter without default


def params(fn):
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        assert p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD), f"{fn.__qualname__} has *{p.name}"
    return [(p.name, REQ if p.default is p.empty else p.default) for p in sig.parameters.values()]


def spec(*items):
    return [(i, REQ) if isinstance(i, str) else i for i in items]


BUFFER = {
    "__init__": spec("self", "group", ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                     ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                     ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)),
    "get_dispatch_layout": spec("self", "topk_idx", "num_experts", ("previous_event", None), ("async_finish", False),
                                ("allocate_on_comm_stream", False)),
    "dispatch": spec("self", "x", ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                     ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                     ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                     ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)),
    "combine": spec("self", "x", "handle", ("topk_weights", None), ("bias", None), ("config", None),
                    ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)),
    "low_latency_dispatch": spec("self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                                 ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                                 ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False),
                                 ("async_finish", False), ("return_recv_hook", False)),
    "low_latency_combine": spec("self", "x", "topk_idx", "topk_weights", "handle", ("use_logfmt", False),
                                ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False),
                                ("out", None), ("combine_wait_recv_cost_stats", None)),
    "get_next_low_latency_combine_buffer": spec("self", "handle"),
    "low_latency_update_mask_buffer": spec("self", "rank_to_mask", ("mask", False)),
    "low_latency_query_mask_buffer": spec("self", "mask_status"),
    "low_latency_clean_mask_buffer": spec("self"),
    "get_local_buffer_tensor": spec("self", "dtype", ("size", None), ("offset", 0), ("use_rdma_buffer", False)),
    "clean_low_latency_buffer": spec("self", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"),
    "destroy": spec("self"),
}
BUFFER_STATIC = {
    "get_low_latency_rdma_size_hint": spec("num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"),
    "get_dispatch_config": spec("num_ranks"),
    "get_combine_config": spec("num_ranks"),
    "set_num_sms": spec("new_num_sms"),
    "capture": spec(),
    "is_sm90_compiled": spec(),
}
ELASTIC = {
    "__init__": spec("self", "group", ("num_bytes", None), ("num_cpu_bytes", 0), ("num_max_tokens_per_rank", 0),
                     ("hidden", 0), ("num_topk", 0), ("use_fp8_dispatch", False), ("deterministic", False),
                     ("allow_hybrid_mode", True), ("allow_multiple_reduction", True),
                     ("prefer_overlap_with_compute", True), ("sl_idx", 3), ("num_allocated_qps", 0),
                     ("num_cpu_timeout_secs", 300), ("num_gpu_timeout_secs", 100), ("explicitly_destroy", False)),
    "dispatch": spec("self", "x", ("topk_idx", None), ("topk_weights", None),
                     ("cumulative_local_expert_recv_stats", None), ("num_experts", None),
                     ("num_max_tokens_per_rank", None), ("expert_alignment", None), ("num_sms", 0), ("num_qps", 0),
                     ("previous_event", None), ("previous_event_before_epilogue", None),
                     ("async_with_compute_stream", False), ("allocate_on_comm_stream", False), ("handle", None),
                     ("do_handle_copy", True), ("do_cpu_sync", None), ("do_expand", False), ("do_zero_padding", False),
                     ("use_tma_aligned_col_major_sf", False)),
    "combine": spec("self", "x", "handle", ("topk_weights", None), ("bias", None), ("num_sms", 0), ("num_qps", 0),
                    ("previous_event", None), ("previous_event_before_epilogue", None),
                    ("async_with_compute_stream", False), ("allocate_on_comm_stream", False)),
    "barrier": spec("self", ("use_comm_stream", True), ("with_cpu_sync", False), ("sequential", True)),
    "get_theoretical_num_sms": spec("self", "num_experts", "num_topk", ("num_scaleout_topk", 0), ("rdma_gbs", 0),
                                    ("nvlink_gbs", 0), ("sm_read_gbs", 200), ("sm_write_gbs", 50)),
    "get_theoretical_num_qps": spec("self", "num_sms"),
    "get_physical_domain_size": spec("self"),
    "get_logical_domain_size": spec("self"),
    "destroy": spec("self"),
}
ELASTIC_STATIC = {
    "get_buffer_size_hint": spec("group", "num_max_tokens_per_rank", "hidden", ("num_topk", 0),
                                 ("use_fp8_dispatch", False), ("allow_hybrid_mode", True),
                                 ("allow_multiple_reduction", True)),
    "capture": spec(),
}


@pytest.mark.parametrize("name", sorted(BUFFER))
def test_buffer_methods(name):
    assert params(getattr(deep_ep.Buffer, name)) == BUFFER[name]


@pytest.mark.parametrize("name", sorted(BUFFER_STATIC))
def test_buffer_static_methods(name):
    assert isinstance(inspect.getattr_static(deep_ep.Buffer, name), staticmethod), f"Buffer.{name} is static in DeepEP"
    assert params(getattr(deep_ep.Buffer, name)) == BUFFER_STATIC[name]


@pytest.mark.parametrize("name", sorted(ELASTIC))
def test_elastic_buffer_methods(name):
    assert params(getattr(deep_ep.ElasticBuffer, name)) == ELASTIC[name]


@pytest.mark.parametrize("name", sorted(ELASTIC_STATIC))
def test_elastic_buffer_static_methods(name):
    assert isinstance(inspect.getattr_static(deep_ep.ElasticBuffer, name), staticmethod)
    assert params(getattr(deep_ep.ElasticBuffer, name)) == ELASTIC_STATIC[name]


def test_buffer_num_sms_class_attribute():
    assert deep_ep.Buffer.num_sms == 20
    assert deep_ep.Buffer.is_sm90_compiled() is False


def test_event_overlap():
    assert params(deep_ep.EventOverlap.__init__) == spec("self", ("event", None), ("extra_tensors", None))
    assert params(deep_ep.EventOverlap.current_stream_wait) == spec("self", ("release_handle", False))
    ev = deep_ep.EventOverlap()
    assert ev.event is None and ev.extra_tensors is None
    t = torch.zeros(2)
    ev = deep_ep.EventOverlap(deep_ep.Buffer.capture().event, extra_tensors=(t,))
    assert ev.extra_tensors[0] is t
    ev.current_stream_wait(release_handle=True)
    assert ev.event is None and ev.extra_tensors is None
    # a context manager whose exit waits
    with deep_ep.EventOverlap(deep_ep.EventHandle()) as e2:
        assert isinstance(e2, deep_ep.EventOverlap)
    # register_hook_after_wait: run once by the wait
    calls = []
    e3 = deep_ep.EventOverlap(deep_ep.EventHandle())
    e3.register_hook_after_wait(lambda: calls.append(1))
    e3.current_stream_wait()
    e3.current_stream_wait()
    assert calls == [1]


def test_capture_returns_our_events():
    v1 = deep_ep.Buffer.capture()
    assert isinstance(v1, deep_ep.EventOverlap) and isinstance(v1.event, deep_ep.EventHandle)
    v2 = deep_ep.ElasticBuffer.capture()
    assert isinstance(v2, deep_ep.EventHandle)
    v2.current_stream_wait()


def test_config_keywords_and_defaults():
    c = deep_ep.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 258)
    # (DeepEP re-aligns the RDMA receive size up to a multiple of the send size: 256 -> 258)
    c = deep_ep.Config(num_sms=24, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=288,
                       num_max_rdma_chunked_send_tokens=16, num_max_rdma_chunked_recv_tokens=128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (24, 8, 288, 16, 128)
    # positional order is DeepEP's: num_sms, nvl send, nvl recv, rdma send, rdma recv
    c = deep_ep.Config(10, 4, 128, 6, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (10, 4, 128)
    # the size hints take DeepEP's keyword names
    assert c.get_nvl_buffer_size_hint(hidden_bytes=1024, num_ranks=2) == c.get_nvl_buffer_size_hint(1024, 2)
    assert c.get_rdma_buffer_size_hint(hidden_bytes=1024, num_ranks=2) == 0  # R <= 8: no RDMA buffer


def _nvl_hint(c, hidden_bytes, R):
    """DeepEP's get_nvl_buffer_size_hint (deepep-v1-buffer.md §1.2)."""
    C, Nn, Nr, T = c.num_sms // 2, min(R, 8), max(R // 8, 1), c.num_max_nvl_chunked_recv_tokens
    v = C * Nn * (2 * Nr + 3) * 4 + C * Nn * T * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    return (v + 127) // 128 * 128


# DeepEP's table (deepep-v1-buffer.md §1.3), the RDMA receive size re-aligned to the send size
@pytest.mark.parametrize("R,dispatch,combine", [(2, (24, 256, 6, 132), (10, 256, 6, 132)),
                                                (4, (6, 256, 6, 132), (9, 256, 6, 132)),
                                                (8, (6, 256, 6, 132), (4, 256, 6, 132)),
                                                (16, (36, 288, 20, 140), (4, 288, 12, 132))])
def test_default_configs(R, dispatch, combine):
    for got, want in ((deep_ep.Buffer.get_dispatch_config(R), dispatch), (deep_ep.Buffer.get_combine_config(R), combine)):
        assert got.num_sms == deep_ep.Buffer.num_sms
        assert (got.num_max_nvl_chunked_send_tokens, got.num_max_nvl_chunked_recv_tokens,
                got.num_max_rdma_chunked_send_tokens, got.num_max_rdma_chunked_recv_tokens) == want
        assert got.get_nvl_buffer_size_hint(7168 * 2, R) == _nvl_hint(got, 7168 * 2, R)


@pytest.mark.parametrize("args,value", [((128, 7168, 8, 256), 1908410496), ((128, 7168, 16, 288), 2146961792),
                                        ((16, 5120, 8, 256), 170395776)])
def test_low_latency_rdma_size_hint(args, value):
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(*args) == value


def test_module_surface():
    assert deep_ep.__version__ == "2.1.0"
    assert deep_ep.topk_idx_t is torch.int64
    for name in ("Buffer", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "Config", "topk_idx_t",
                 "get_physical_domain_size", "get_logical_domain_size"):
        assert hasattr(deep_ep, name), name
    assert params(deep_ep.get_physical_domain_size) == spec("group")
    assert params(deep_ep.get_logical_domain_size) == spec("group", ("allow_hybrid_mode", True))
    import moe_ep.deep_ep.utils as utils
    assert utils.EventHandle is deep_ep.EventHandle and utils.EventOverlap is deep_ep.EventOverlap


def test_alias_directory_import():
    """`import deep_ep` (build/deep_ep_alias on PYTHONPATH) is moe_ep.deep_ep, with its submodules."""
    import importlib
    alias = importlib.import_module("deep_ep")
    from deep_ep import Buffer, Config, ElasticBuffer  # (what engines import)
    from deep_ep.utils import EventHandle, EventOverlap
    assert alias is deep_ep
    assert Buffer is deep_ep.Buffer and ElasticBuffer is deep_ep.ElasticBuffer and Config is deep_ep.Config
    assert EventHandle is deep_ep.EventHandle and EventOverlap is deep_ep.EventOverlap
    assert importlib.import_module("deep_ep.buffers.elastic").ElasticBuffer is ElasticBuffer
    assert importlib.import_module("deep_ep.buffers.legacy").Buffer is Buffer
    assert alias.__version__ == "2.1.0"


def test_domain_sizes_of_local_world():
    def fn(g):
        return (deep_ep.get_physical_domain_size(g), deep_ep.get_logical_domain_size(g),
                deep_ep.get_logical_domain_size(g, allow_hybrid_mode=False))
    assert moe_ep.LocalWorld(4, 2).run(fn) == [((2, 2), (2, 2), (1, 4))] * 4
    assert moe_ep.LocalWorld(2).run(fn) == [((1, 2), (1, 2), (1, 2))] * 2


def test_exceptions_hierarchy():
    assert issubclass(moe_ep.Error, RuntimeError)
    assert issubclass(moe_ep.InvalidArgument, moe_ep.Error) and issubclass(moe_ep.InvalidArgument, ValueError)
    assert issubclass(moe_ep.CapacityError, moe_ep.InvalidArgument)
    for cls in (moe_ep.StateError, moe_ep.ResourceError, moe_ep.PeerError):
        assert issubclass(cls, moe_ep.Error)
    assert issubclass(moe_ep.TimeoutError, moe_ep.PeerError) and issubclass(moe_ep.TimeoutError, TimeoutError)


def test_dispatcher_surface():
    assert params(moe_ep.TokenDispatcher.__init__)[:7] == spec(
        "self", "cache", "hidden", "num_experts", "num_topk", ("use_v2", None), ("mode", None))
    assert ("num_max_dispatch_tokens_per_rank", None) in params(moe_ep.TokenDispatcher.__init__)
    assert params(moe_ep.TokenDispatcher.dispatch)[:5] == spec("self", "hidden_states", "topk_idx", "topk_weights",
                                                               ("kind", "prefill"))
    assert params(moe_ep.probe_providers) == spec(("path_list", ""))
    assert params(moe_ep.LocalWorld.__init__) == spec("self", "num_ranks", ("num_scaleout", 1))
