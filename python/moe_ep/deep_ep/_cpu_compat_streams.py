"""The CPU compatibility layer's streams and events (``moe_ep.deep_ep.cpu_compat`` installs them as
``torch.cuda.Stream``, ``Event``, ``current_stream``, ``default_stream``, ``stream`` and
``set_stream``), and the count of the layer's calls (``cpu_compat.calls()``). CPU work runs in
program order, so there is nothing to wait for: waits return at once, events are complete once
recorded."""

import contextlib
import threading
import time

import torch

_calls = {}  # stand-in name -> calls since install() (calls())


def _count(name):
    _calls[name] = _calls.get(name, 0) + 1


# ---- streams and events ------------------------------------------------------------------------

class Stream:
    """A CPU stand-in for torch.cuda.Stream: work is already ordered, waits return at once. As a
    context manager it is the current stream of the block (``torch.cuda.current_stream()``).

    Arguments:
        device: the device torch.cuda.Stream takes, default None; ignored (``device`` is the CPU).
        priority: int, default 0, kept as ``priority``.
        kwargs: torch.cuda.Stream's other keyword arguments; ignored.
    """

    def __init__(self, device=None, priority=0, **kwargs):
        _count("torch.cuda.Stream")
        self.device = torch.device("cpu")
        self.priority = priority
        self.stream_id = id(self)
        self.cuda_stream = 0

    def wait_stream(self, stream):
        """Returns at once: the work of ``stream`` is already done.

        Arguments:
            stream: the stream to wait for (a stand-in or any other).
        """

    def wait_event(self, event):
        """Returns at once: the work before ``event`` is already done.

        Arguments:
            event: the event to wait for (a stand-in or any other).
        """

    def record_event(self, event=None):
        """Records an event on this stream.

        Arguments:
            event: a stand-in ``Event`` to record, or None (default): a new one.

        Returns:
            event: the recorded ``Event``.
        """
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self):
        """Whether the stream's work is done: always.

        Returns:
            done: bool, True.
        """
        return True

    def synchronize(self):
        """Returns at once: the stream's work is already done."""

    def is_capturing(self):
        """No graph capture on the CPU (torch.cuda.Stream.is_capturing's answer outside a capture)."""
        return False

    def __enter__(self):
        _stream_context_stack().append(self)
        return self

    def __exit__(self, *exc):
        _stream_context_stack().pop()
        return False

    def __eq__(self, other):
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self):
        return hash(self.stream_id)

    def __repr__(self):
        return f"<moe_ep cpu_compat Stream {self.stream_id:#x}>"


class Event:
    """A CPU stand-in for torch.cuda.Event: complete once recorded; elapsed_time is host time.

    Arguments:
        enable_timing: bool, default False: ``elapsed_time`` may be asked of it.
        blocking: bool, default False; ignored.
        interprocess: bool, default False; ignored.
        kwargs: torch.cuda.Event's other keyword arguments; ignored.
    """

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        _count("torch.cuda.Event")
        self.enable_timing = enable_timing
        self._recorded_at = None

    def record(self, stream=None):
        """Records the event: complete at once, the host clock noted for ``elapsed_time``.

        Arguments:
            stream: the stream to record on, default None (the current one); ignored.
        """
        self._recorded_at = time.perf_counter()

    def wait(self, stream=None):
        """Returns at once: the work before the event is already done.

        Arguments:
            stream: the stream that would wait, default None; ignored.
        """

    def query(self):
        """Whether the event completed: always.

        Returns:
            done: bool, True.
        """
        return True

    def synchronize(self):
        """Returns at once: the event is complete."""

    def elapsed_time(self, end_event):
        """Host time between the recording of this event and of ``end_event``.

        Arguments:
            end_event: a recorded stand-in ``Event``; both created with ``enable_timing=True``
                (``RuntimeError`` otherwise).

        Returns:
            milliseconds: float.
        """
        if not self.enable_timing or not getattr(end_event, "enable_timing", False):
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end_event._recorded_at - self._recorded_at) * 1e3

    def __repr__(self):
        return "<moe_ep cpu_compat Event>"


_default_stream = Stream()
_thread = threading.local()


def _stream_context_stack():
    if not hasattr(_thread, "streams"):
        _thread.streams = []
    return _thread.streams


def _current_stream(device=None):
    stack = _stream_context_stack()
    return stack[-1] if stack else getattr(_thread, "current", _default_stream)


def _set_stream(stream):
    _thread.current = stream


@contextlib.contextmanager
def _stream(stream):
    if stream is None:
        yield
        return
    with stream:
        yield
