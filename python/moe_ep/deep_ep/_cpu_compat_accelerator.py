"""The CPU compatibility layer's torch.accelerator (moe_ep.deep_ep.cpu_compat installs it): the
stand-in device as the current accelerator, answering as the layer's torch.cuda; and torch.cuda's
is_available as torch answers it without the layer."""

import types

import torch

from . import cpu_compat as layer

def truthful_is_available(original, torch_functions):
    """torch.cuda.is_available as torch answers it without the layer. torch's function reads
    torch.cuda.device_count when PYTORCH_NVML_BASED_CUDA_CHECK=1, which the layer answers; this is
    the same code reading torch's own functions (torch_functions: name -> torch's function)."""
    if not isinstance(original, types.FunctionType):
        return original
    names = dict(original.__globals__)
    names.update(torch_functions)
    truthful = types.FunctionType(original.__code__, names, original.__name__, original.__defaults__,
                                  original.__closure__)
    truthful.__doc__ = original.__doc__
    truthful.__qualname__ = original.__qualname__
    truthful.__wrapped__ = original
    return truthful


_CUDA = torch.device("cuda")


def _accelerator_index(device, optional):
    """The device index a torch.accelerator call names, by torch's rules: an int, or a CUDA device
    with an index; None or a device without an index names the current one where the argument is
    optional."""
    if device is None and optional:
        return layer._state["current"]
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"{device.type} doesn't match the current accelerator {_CUDA}.")
        if device.index is None:
            if not optional:
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            return layer._state["current"]
        device = device.index
    return layer._index(device)


def _set_device_index(device, /):
    index = device if isinstance(device, int) and not isinstance(device, bool) else None
    if index is not None and index < 0:
        return  # torch: a negative index changes nothing
    layer._state["current"] = _accelerator_index(device, optional=False)


class _DeviceIndexContext(layer._DeviceContext):
    """torch.accelerator.device_index(i): selects device i inside the block (None: no change)."""

    def __init__(self, device, /):
        layer._count("torch.accelerator.device_index")
        self.index = None if device is None else _accelerator_index(device, optional=False)


def _functions():
    """torch.accelerator's attributes the layer replaces (those this torch has), and what replaces
    them: the answers of the layer's torch.cuda, with CUDA as the current accelerator."""
    def current_stream(device=None, /):
        _accelerator_index(device, optional=True)
        return layer._current_stream()

    def synchronize(device=None, /):
        _accelerator_index(device, optional=True)

    def current_device_index():
        return layer._state["current"]

    return {
        "current_accelerator": lambda check_available=False: (
            _CUDA if not check_available or torch.cuda.is_available() else None),
        "is_available": lambda: torch.cuda.is_available(),
        "device_count": lambda: layer._state["device_count"],
        "current_device_index": current_device_index,
        "current_device_idx": current_device_index,
        "set_device_index": _set_device_index,
        "set_device_idx": _set_device_index,
        "device_index": _DeviceIndexContext,
        "current_stream": current_stream,
        "set_stream": layer._set_stream,
        "synchronize": synchronize,
        "empty_cache": lambda: None,
        "get_memory_info": lambda device=None, /: (layer._host_bytes("SC_AVPHYS_PAGES"), layer._host_bytes()),
        "memory_allocated": lambda device=None, /: 0,
        "max_memory_allocated": lambda device=None, /: 0,
        "memory_reserved": lambda device=None, /: 0,
        "max_memory_reserved": lambda device=None, /: 0,
        "reset_peak_memory_stats": lambda device=None, /: None,
    }


def install(replaced, counted):
    """Replaces torch.accelerator's functions that this torch has (torch 2.6 and later), recording
    torch's own in `replaced` (cpu_compat.uninstall restores them); counted(name, fn) counts calls."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return
    for name, fn in _functions().items():
        if hasattr(accelerator, name):  # only what this torch has
            replaced[("accelerator", name)] = getattr(accelerator, name)
            setattr(accelerator, name, fn if isinstance(fn, type) else counted(f"torch.accelerator.{name}", fn))
