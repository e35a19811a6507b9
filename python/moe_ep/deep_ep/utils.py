"""Events, as DeepEP's ``deep_ep.utils`` has them.

On CPU there are no streams: an ``EventHandle`` stands for "the work launched so far" and is
complete when captured (``Buffer.capture()``); the events buffers return with ``async_finish`` /
``async_with_compute_stream`` complete when the rank's communication worker finishes the call.
``current_stream_wait()`` blocks the calling thread until then (with the GIL released).
"""

from .. import _C


class EventHandle:
    """An event: ``current_stream_wait()`` waits for it. ``EventHandle()`` is already complete.

    Arguments:
        event: the moe-ep event (``moe_ep._C.Event``) it stands for; None (the default) makes one
            that is already complete, as ``capture()`` returns it (on CPU there is no stream to
            record on).
    """

    def __init__(self, event=None):
        self._event = _C.Event() if event is None else event

    def current_stream_wait(self):
        """Blocks the calling thread (with the GIL released) until the event completes; raises the
        error of the call it belongs to if that call failed on the communication worker."""
        self._event.wait()

    def query(self):
        """Whether the event completed, without waiting.

        Returns:
            done: bool, True once the work it stands for finished.
        """
        return self._event.query()


class EventOverlap:
    """A returned event with the tensors it keeps alive; also a context manager
    (``with event: ...`` waits for the event when the block ends).

    Arguments:
        event: an ``EventHandle``, or None: the event of a synchronous call (nothing to wait for).
        extra_tensors: tensors to keep alive until the event is released (DeepEP's way to avoid
            ``record_stream``); None by default.
    """

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._hook = None

    def current_stream_wait(self, release_handle=False):
        """Waits for the event (blocking the calling thread on CPU), then runs the hook registered
        with ``register_hook_after_wait`` (once).

        Arguments:
            release_handle: bool, default False; True drops the event and ``extra_tensors`` after
                the wait.
        """
        assert self.event is not None
        self.event.current_stream_wait()
        if self._hook is not None:
            hook, self._hook = self._hook, None
            hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def register_hook_after_wait(self, hook):
        """Registers a callable run once after the next ``current_stream_wait`` (at most one hook).

        Arguments:
            hook: a callable taking no arguments.
        """
        assert self._hook is None, "only one hook may be registered"
        self._hook = hook

    def __call__(self, release_handle=False):
        self._release_on_exit = release_handle
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if self.event is not None:
            self.current_stream_wait(release_handle=getattr(self, "_release_on_exit", False))


def _overlap(native_event, async_):
    """The EventOverlap a call returns: wrapping its event when asynchronous, else None inside."""
    return EventOverlap(EventHandle(native_event) if async_ else None)


def _native(event, name):
    """The moe-ep event inside an EventHandle or EventOverlap argument (None stays None; anything
    else passes through, for the extension to refuse on every rank)."""
    if isinstance(event, EventOverlap):
        event = event.event
    if isinstance(event, EventHandle):
        return event._event
    return event
