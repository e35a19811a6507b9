"""``import deep_ep`` resolves to ``moe_ep.deep_ep`` when this directory is on PYTHONPATH (for an
engine's CI: its DeepEP code then runs on moe-ep)."""
import sys

import moe_ep.deep_ep as _impl
import moe_ep.deep_ep.buffers.elastic
import moe_ep.deep_ep.buffers.legacy
import moe_ep.deep_ep.utils
import moe_ep.deep_ep.cpu_compat
import moe_ep.deep_ep.hybrid_ep_buffer

for _name in ("utils", "buffers", "buffers.legacy", "buffers.elastic", "cpu_compat", "hybrid_ep_buffer"):
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"moe_ep.deep_ep.{_name}"]
sys.modules[__name__] = _impl
