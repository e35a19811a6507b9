"""Per-rank scenarios shared by the thread (LocalWorld) and process (gloo) tests.

Each scenario runs on one rank with its group (a moe_ep.Group or a torch.distributed group),
builds every rank's inputs from a seed (tests/python/reference.py), calls moe-ep through DeepEP's
API and checks every output against the reference; it returns a small summary (plain values).

One module per generation and mode (v2, v1_normal, v1_low_latency), what they share in common.
"""
from .common import _fp8_pair, assert_same, group_info  # noqa: F401
from .v1_low_latency import check_ll_dispatch, ll_order_is_source_then_token, v1_low_latency  # noqa: F401
from .v1_normal import exp_bf16_rows, v1_buffer, v1_normal  # noqa: F401
from .v2 import v2_compact, v2_expanded  # noqa: F401
