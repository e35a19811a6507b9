"""The comparison of a dump's arrays with their expectation (bit for bit), the list of mismatches,
which stops the check after MAX_ERRORS of them, and the check of every token's combined outputs."""
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


def check_combined(err, sources, load, expected_x, expected_w):
    """Every token's combined_x and combined_topk_weights on every rank against expected_x(src, t)
    and expected_w(src, t)."""
    for s, src in enumerate(sources):
        combined, combined_w = load(s, "combined_x"), load(s, "combined_topk_weights")
        for t in range(src.n):
            if not bitwise(combined[t], expected_x(src, t)):
                err.add(f"rank {s}: combined_x token {t}")
            if not bitwise(combined_w[t], expected_w(src, t)):
                err.add(f"rank {s}: combined_topk_weights token {t}")
