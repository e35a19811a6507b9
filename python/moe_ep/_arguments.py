"""Integer arguments of the Python layer (docs/python.md, "Errors").

``int32`` / ``int64`` convert an argument the way the extension converts the integers of its
collective calls (``_C.integer``): an int or an object with ``__index__`` (numpy integers, integer
0-d tensors), not a bool or a float (``TypeError`` naming the argument); a value outside the range
is a ``moe_ep.InvalidArgument`` (a ``ValueError``) naming the argument, the value and the limit:
``num_experts = 18446744073709551616 is out of range (must be at most 2147483647)``.

``Conversions`` converts the arguments of a collective call without raising, so that a rank whose
arguments cannot be converted still takes part in the call as a rejection: it raises its own error,
its peers ``moe_ep.PeerError`` naming it, and no rank waits for it.
"""

from . import _C

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


def int32(value, name, low=INT32_MIN, high=INT32_MAX):
    """value as an int in [low, high] (an argument the C++ layer takes as an int)."""
    return _C.integer(value, name, low, high)


def int64(value, name, low=INT64_MIN):
    """value as an int in [low, 2**63 - 1] (an argument the C++ layer takes as an int64_t)."""
    return _C.integer(value, name, low, INT64_MAX)


def optional_int32(value, name, low=INT32_MIN):
    return None if value is None else int32(value, name, low)


class Conversions:
    """The integer arguments of one collective call: the first failure is kept (``error``) and
    the value 0 given in its place; ``agree`` then makes every rank learn of it."""

    def __init__(self):
        self.error = None

    def int32(self, value, name, low=INT32_MIN, high=INT32_MAX):
        return self._convert(int32, value, name, low, high)

    def int64(self, value, name, low=INT64_MIN):
        return self._convert(int64, value, name, low)

    def _convert(self, convert, *args):
        if self.error is None:
            try:
                return convert(*args)
            except (TypeError, ValueError) as e:
                self.error = e
        return 0

    @property
    def rejection(self):
        """The kept error as a message ("" when every argument converted)."""
        return "" if self.error is None else f"{type(self.error).__name__}: {self.error}"

    def agree(self, group, context):
        """Collective over ``group`` (a moe_ep.Group): this rank raises its kept error, the others
        ``PeerError`` naming the ranks that kept one; returns when no rank did."""
        blocks = group.all_gather_bytes(self.rejection.encode())
        if self.error is not None:
            raise self.error
        bad = [r for r, block in enumerate(blocks) if block]
        if bad:
            error = _C.PeerError(f"{context}: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} rejected "
                                 f"its arguments; rank {bad[0]}: {blocks[bad[0]].decode()}")
            error.ranks = bad
            raise error
