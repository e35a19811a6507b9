"""Which provider backs a Python ``ElasticBuffer`` (docs/python.md, "CUDA tensors").

The CUDA provider when all of these hold, else moe-ep's built-in CPU provider:

- ``torch.cuda.is_available()`` (False under ``cpu_compat``);
- a CUDA provider library is found: the V2 provider ``MOE_EP_PROVIDER_PATH`` resolves to, when it
  is set (as the token dispatcher resolves it, so ``MOE_EP_PROVIDER_PATH=cpu`` keeps the built-in
  provider), else ``libmoe_ep_cuda.so`` beside ``libmoe_ep.so``;
- its ``init()`` found a CUDA device.

The buffer works on torch's current device, which must be the device the CUDA provider gives the
rank (local rank % devices); otherwise construction fails on every rank, naming both.
"""

import os
from dataclasses import dataclass

import torch

from ... import _C


@dataclass
class Choice:
    cuda: bool
    device: int = -1
    why_host: str = ""  # without cuda: why (named when CUDA tensors are refused)
    refusal: str = ""  # non-empty: this rank cannot build the buffer it chose
    provider_path: str = ""


def provider_path():
    """MOE_EP_PROVIDER_PATH as the token dispatcher reads it (empty when unset)."""
    return os.environ.get("MOE_EP_PROVIDER_PATH", "")


def _cpu(reason):
    return Choice(False, why_host=f"this ElasticBuffer runs on moe-ep's built-in CPU provider, which moves host "
                                  f"tensors ({reason})")


def choose(group, cuda_available=None, found=None):
    """The Choice for a rank of ``group`` (a moe_ep Group). ``cuda_available`` and ``found`` (the
    dict of ``_C.cuda_provider``) default to torch's answer and the library's probe."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return _cpu("torch.cuda.is_available() is False")
    path = provider_path()
    if found is None:
        found = _C.cuda_provider(path)
    if not found["available"]:
        return _cpu(found["reason"])
    device = torch.cuda.current_device()
    count = torch.cuda.device_count()
    local_rank = group.rank() % group.num_scaleup
    expected = local_rank % count
    refusal = ""
    if device != expected:
        refusal = (f"[rank {group.rank()}] ElasticBuffer: torch's current device is cuda:{device}, but the CUDA "
                   f"provider runs local rank {local_rank} on cuda:{expected} (local rank % {count} devices): call "
                   f"torch.cuda.set_device({expected}) before building the buffer")
    return Choice(True, device=device, refusal=refusal, provider_path=path)


def current_stream(device):
    """The cudaStream_t of torch's current stream on ``device`` (an int), for the CUDA provider."""
    return torch.cuda.current_stream(device).cuda_stream
