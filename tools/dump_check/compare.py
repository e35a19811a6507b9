"""The comparison of a dump's arrays with their expectation (bit for bit) and the list of
mismatches, which stops the check after MAX_ERRORS of them."""
import numpy as np

MAX_ERRORS = 20


class Mismatches(Exception):
    pass


class Errors:
    def __init__(self):
        self.items = []

    def add(self, text):
        self.items.append(text)
        if len(self.items) >= MAX_ERRORS:
            raise Mismatches()


def bitwise(a, b):
    """Equal shapes and bits (float32 compared as bits, so -0 and NaN payloads count)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    return np.array_equal(a, b)
