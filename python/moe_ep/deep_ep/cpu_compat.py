"""An opt-in CPU compatibility layer for engines' CI: code written for GPUs runs its DeepEP path
on a CPU-only host.

Off unless asked for: ``install()`` (or ``MOE_EP_CPU_COMPAT=1`` in the environment when
``moe_ep.deep_ep`` or the alias ``deep_ep`` is imported), undone by ``uninstall()``; ``enabled()``
is the same as a context manager. A process that never asks sees torch exactly as it is. Once
installed:

- ``torch.cuda``'s device queries answer for a stand-in device: ``device_count()``,
  ``current_device()``, ``set_device(i)`` (any index up to the device count),
  ``torch.cuda.device(i)``, ``get_device_properties(...)`` (``multi_processor_count``,
  ``total_memory`` = the host's memory, ``major``/``minor``, ``name``), ``get_device_capability()``,
  ``get_device_name()``; memory queries answer from the host (``mem_get_info``) or 0.
- Streams and events are CPU stand-ins with the same methods: ``torch.cuda.Stream``,
  ``current_stream()``, ``default_stream()``, ``stream(s)``, ``set_stream(s)``,
  ``torch.cuda.Event`` (``record``, ``wait``, ``query``, ``synchronize``, ``elapsed_time`` from the
  host clock), ``synchronize()``, ``is_current_stream_capturing()`` and ``Stream.is_capturing()``
  (False). CPU work runs in program order, so there is nothing to wait for; moe-ep's asynchronous
  calls still complete through their own events (``event.current_stream_wait()``), as on GPUs.
- ``torch.accelerator`` (torch 2.6 and later; the functions this torch has) answers as the layer's
  ``torch.cuda``: ``current_accelerator()`` is ``torch.device("cuda")``, ``device_count()``,
  ``current_device_index()``, ``set_device_index(i)``, ``device_index(i)``, ``current_stream()``
  (the layer's stream), ``set_stream(s)``, ``synchronize()`` and the memory queries;
  ``is_available()`` is ``torch.cuda.is_available()``.
- ``device="cuda"`` (``"cuda:N"``, ``torch.device("cuda", N)``, an int device index) in torch's
  functions, ``Tensor.to(...)``, ``Tensor.cuda()`` and ``torch.set_default_device("cuda")`` mean
  the CPU; ``pin_memory=True`` is dropped; ``Tensor.record_stream`` and ``pin_memory()`` do nothing. Like torch's own
  default device, this applies on the thread that installed the layer and on the ranks of
  ``moe_ep.LocalWorld``; other threads call ``enter_thread()``.
- ``torch.distributed.init_process_group`` and ``new_group`` with the ``nccl`` backend use
  ``gloo`` (and ignore ``device_id``). ``all_gather_into_tensor`` into the stacked form
  (``[world, n, ...]`` for an input ``[n, ...]``, which NCCL takes and DeepEP's tests use, gloo
  does not) gathers through the concatenated view ``[world * n, ...]`` of the same storage.

``torch.cuda.is_available()`` and ``torch.accelerator.is_available()`` keep torch's own answer,
False on a host without a GPU, also with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (where torch's
``is_available`` counts devices): code that asks gets the truth, so torch and Triton never launch
device work for the stand-in device (current_accelerator(check_available=True) is None). Install before
the engine imports names from ``torch.cuda`` (``from torch.cuda import current_stream`` keeps
torch's function). docs/integration.md, "Use moe-ep in your engine's CPU CI".
"""

import contextlib
import os
import threading
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from .. import _groups
# The stand-in streams and events, and the count of the layer's calls.
from ._cpu_compat_streams import (Event, Stream, _calls, _count, _current_stream, _default_stream,
                                  _set_stream, _stream, _thread)

__all__ = ["install", "uninstall", "installed", "enabled", "enter_thread", "calls", "Stream", "Event"]

_lock = threading.RLock()
_state = None  # while installed: the settings and what was replaced


# ---- the stand-in device ------------------------------------------------------------------------

def _host_bytes(pages="SC_PHYS_PAGES"):
    """The host's memory (SC_PHYS_PAGES) or what is free of it (SC_AVPHYS_PAGES); 0 if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
    except (ValueError, OSError, AttributeError):
        return 0


def _index(device):
    """The device index a torch.cuda query names (None: the current one)."""
    if device is None:
        return _state["current"]
    if isinstance(device, int):
        index = device
    else:
        d = torch.device(device)
        if d.type not in ("cuda", "cpu"):
            raise ValueError(f"device {device!r} is not a CUDA device")
        index = _state["current"] if d.index is None else d.index
    if not 0 <= index < _state["device_count"]:
        raise ValueError(f"device index {index} is outside the {_state['device_count']} devices of moe_ep's "
                         f"cpu_compat layer (install(device_count=...))")
    return index


def _properties(device=None):
    index = _index(device)
    s = _state
    return types.SimpleNamespace(name=f"moe-ep cpu_compat device {index}", major=s["capability"][0],
                                 minor=s["capability"][1], multi_processor_count=s["multi_processor_count"],
                                 total_memory=_host_bytes(), is_integrated=False, is_multi_gpu_board=False,
                                 uuid=f"moe-ep-cpu-compat-{index}", L2_cache_size=0, warp_size=32)


def _capability(device=None):
    _index(device)
    return tuple(_state["capability"])


def _set_device(device):
    _state["current"] = _index(device)


class _DeviceContext:
    """torch.cuda.device(i): selects device i inside the block."""

    def __init__(self, device):
        _count("torch.cuda.device")
        self.index = None if device is None or (isinstance(device, int) and device < 0) else _index(device)

    def __enter__(self):
        self.previous = _state["current"]
        if self.index is not None:
            _state["current"] = self.index
        return self

    def __exit__(self, *exc):
        _state["current"] = self.previous
        return False


def _cuda_functions():
    """torch.cuda's attributes the layer replaces, and what replaces them."""
    return {
        "device_count": lambda: _state["device_count"],
        "current_device": lambda: _state["current"],
        "set_device": _set_device,
        "device": _DeviceContext,
        "get_device_properties": _properties,
        "get_device_capability": _capability,
        "get_device_name": lambda device=None: _properties(device).name,
        "synchronize": lambda device=None: None,
        "Stream": Stream,
        "Event": Event,
        "current_stream": _current_stream,
        "default_stream": lambda device=None: _default_stream,
        "stream": _stream,
        "set_stream": _set_stream,
        "is_current_stream_capturing": lambda: False,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (_host_bytes("SC_AVPHYS_PAGES"), _host_bytes()),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
    }


# ---- device="cuda" means the CPU ---------------------------------------------------------------

def _is_cuda_device(d):
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    return isinstance(d, int) and not isinstance(d, bool)


_CPU = torch.device("cpu")


class _CudaOnCpu(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call of this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            _count("device mapped")
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = _CPU
            _count("device mapped")
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
            _count("device mapped")
        return func(*args, **kwargs)


def _record_stream(tensor, stream):
    _count("Tensor.record_stream")


def enter_thread():
    """Makes device="cuda" mean the CPU on the calling thread too (threads started after install)."""
    with _lock:
        if _state is None:
            raise RuntimeError("moe_ep's cpu_compat layer is not installed")
    if getattr(_thread, "mode", None) is None:
        mode = _CudaOnCpu()
        mode.__enter__()
        _thread.mode = mode


def _leave_thread():
    mode = getattr(_thread, "mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
        _thread.mode = None


def _on_rank_threads(fn):
    """LocalWorld's ranks: each rank's thread gets the device mapping."""
    def run_on_rank(group):
        enter_thread()
        try:
            return fn(group)
        finally:
            _leave_thread()
    return run_on_rank


# ---- torch.distributed: nccl means gloo ---------------------------------------------------------

def _gloo_backend(backend):
    if backend is None or "nccl" not in str(backend).lower():
        return backend
    _count("nccl -> gloo")
    return "gloo"


def _wrap_init_process_group(original):
    def init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("device_id", None)
        return original(_gloo_backend(backend), *args, **kwargs)
    init_process_group.__wrapped__ = original
    return init_process_group


def _wrap_new_group(original):
    def new_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = _gloo_backend(kwargs["backend"])
        elif len(args) > 2:
            args = args[:2] + (_gloo_backend(args[2]),) + tuple(args[3:])
        kwargs.pop("device_id", None)
        return original(*args, **kwargs)
    new_group.__wrapped__ = original
    return new_group


def _wrap_all_gather_into_tensor(original):
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if (input_tensor.dim() >= 1 and output_tensor.dim() == input_tensor.dim() + 1
                and tuple(output_tensor.shape[1:]) == tuple(input_tensor.shape) and output_tensor.is_contiguous()):
            _count("stacked all_gather_into_tensor")
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
        return original(output_tensor, input_tensor, group=group, async_op=async_op)
    all_gather_into_tensor.__wrapped__ = original
    return all_gather_into_tensor


# ---- what was used --------------------------------------------------------------------------------

def _counted(name, fn):
    """fn, counting its calls under `name` (calls() reports them)."""
    def counted(*args, **kwargs):
        _count(name)
        return fn(*args, **kwargs)
    counted.__name__ = getattr(fn, "__name__", name)
    counted.__doc__ = getattr(fn, "__doc__", None)
    return counted


def calls():
    """How often each stand-in was called since install(): what an engine's DeepEP path needs of
    the layer.

    Returns:
        calls: a dict, ``{"torch.cuda.get_device_properties": n, ..., "device mapped": n,
            "nccl -> gloo": n}``.
    """
    return dict(_calls)


# ---- install / uninstall ------------------------------------------------------------------------

def install(device_count=8, multi_processor_count=132, capability=(9, 0)):
    """Installs the layer (idempotent: a second call with other settings updates them).

    Arguments:
        device_count: int >= 1, default 8: how many stand-in devices torch.cuda reports.
        multi_processor_count: int >= 1, default 132: what get_device_properties reports (an H100's).
        capability: a (major, minor) pair of ints, default (9, 0): the devices' compute capability.
    """
    global _state
    if not isinstance(device_count, int) or isinstance(device_count, bool) or device_count < 1:
        raise ValueError(f"device_count = {device_count!r}; expected an int >= 1")
    if not isinstance(multi_processor_count, int) or isinstance(multi_processor_count, bool) or multi_processor_count < 1:
        raise ValueError(f"multi_processor_count = {multi_processor_count!r}; expected an int >= 1")
    if (not isinstance(capability, tuple) or len(capability) != 2
            or not all(isinstance(v, int) and v >= 0 for v in capability)):
        raise ValueError(f"capability = {capability!r}; expected a (major, minor) pair of ints")
    from . import _cpu_compat_accelerator as _accelerator  # it builds on this module's stand-ins
    with _lock:
        if _state is not None:
            _state.update(device_count=device_count, multi_processor_count=multi_processor_count,
                          capability=capability, current=min(_state["current"], device_count - 1))
            return
        replaced = {}
        state = dict(device_count=device_count, multi_processor_count=multi_processor_count, capability=capability,
                     current=0, replaced=replaced)
        cuda_functions = _cuda_functions()
        # is_available keeps torch's answer (it would count the layer's devices under
        # PYTORCH_NVML_BASED_CUDA_CHECK=1).
        cuda_functions["is_available"] = _accelerator.truthful_is_available(
            torch.cuda.is_available, {name: getattr(torch.cuda, name) for name in cuda_functions
                                      if hasattr(torch.cuda, name)})
        for name, fn in cuda_functions.items():
            replaced[("cuda", name)] = getattr(torch.cuda, name, None)
            # Classes stay classes (isinstance works); they count their own constructions.
            setattr(torch.cuda, name, fn if isinstance(fn, type) or name == "is_available"
                    else _counted(f"torch.cuda.{name}", fn))
        _accelerator.install(replaced, _counted)
        # record_stream(stream) with a stand-in stream: nothing to record (torch's argument parser
        # refuses a stream that is not a torch.Stream before any mode sees the call).
        replaced[("tensor", "record_stream")] = torch.Tensor.record_stream
        torch.Tensor.record_stream = _record_stream
        replaced[("torch", "set_default_device")] = torch.set_default_device
        original_default = torch.set_default_device

        def set_default_device(device):
            if _is_cuda_device(device):
                _count("device mapped")
                device = _CPU
            return original_default(device)
        torch.set_default_device = set_default_device
        replaced[("dist", "init_process_group")] = dist.init_process_group
        dist.init_process_group = _wrap_init_process_group(dist.init_process_group)
        replaced[("dist", "new_group")] = dist.new_group
        dist.new_group = _wrap_new_group(dist.new_group)
        replaced[("dist", "all_gather_into_tensor")] = dist.all_gather_into_tensor
        dist.all_gather_into_tensor = _wrap_all_gather_into_tensor(dist.all_gather_into_tensor)
        _state = state
        _calls.clear()
        _groups.rank_thread_wrappers.append(_on_rank_threads)
        enter_thread()


def uninstall():
    """Restores everything install() replaced (call it on the thread that installed)."""
    global _state
    with _lock:
        if _state is None:
            return
        for (where, name), original in _state["replaced"].items():
            target = {"cuda": torch.cuda, "torch": torch, "dist": dist, "tensor": torch.Tensor,
                      "accelerator": getattr(torch, "accelerator", None)}[where]
            if original is None:
                delattr(target, name)
            else:
                setattr(target, name, original)
        if _on_rank_threads in _groups.rank_thread_wrappers:
            _groups.rank_thread_wrappers.remove(_on_rank_threads)
        _state = None
    _leave_thread()


def installed():
    """Whether the layer is installed.

    Returns:
        installed: bool.
    """
    return _state is not None


@contextlib.contextmanager
def enabled(**settings):
    """A context manager: install() for the block, uninstall() after it (unless it was installed
    before).

    Arguments:
        settings: install()'s keyword arguments (``device_count``, ``multi_processor_count``,
            ``capability``).
    """
    was = installed()
    install(**settings)
    try:
        yield
    finally:
        if not was:
            uninstall()


def _install_from_environment():
    """MOE_EP_CPU_COMPAT=1 installs the layer when moe_ep.deep_ep is imported (read through the
    registry: a value that is not a bool raises InvalidArgument naming the variable)."""
    from .. import _C
    if _C.env_bool("MOE_EP_CPU_COMPAT"):
        install()
