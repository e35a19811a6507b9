#!/usr/bin/env python3
"""Compares two dump trees (scripts/fixed-dumps.sh, docs/dump-format.md) byte for byte and exits 1
naming every file that differs. Low-latency slabs ([local experts, capacity, hidden]
hidden_states / expert_out / recv_x) are compared on their received rows only (masked_m or
packed_recv_count): the rest of a slab is never written, so it holds whatever the memory held.

Usage: scripts/compare-dumps.py BEFORE_DIR AFTER_DIR   (needs numpy: the project's .venv has it)
"""
import pathlib
import sys

import numpy as np

SLABS = ("_hidden_states", "_expert_out")


def slab_counts(tree, path):
    prefix = path.name
    for suffix in SLABS:
        prefix = prefix.split(suffix)[0]
    for name in (f"{prefix}_masked_m.npy", f"{prefix}_packed_recv_count.npy"):
        if (tree / path.parent / name).exists():
            return np.load(tree / path.parent / name).reshape(-1)
    return None


def differs(a, b, rel):
    x, y = np.load(a / rel), np.load(b / rel)
    if x.shape != y.shape or x.dtype != y.dtype:
        return f"shape or dtype ({x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)})"
    counts = slab_counts(a, rel) if x.ndim == 3 and any(s in rel.name for s in SLABS) else None
    if counts is None:
        return None if x.tobytes() == y.tobytes() else "bytes"
    other = slab_counts(b, rel)
    if other is None or not np.array_equal(counts, other):
        return "slab counts"
    for e, c in enumerate(counts[: x.shape[0]]):
        if x[e, :c].tobytes() != y[e, :c].tobytes():
            return f"received rows of slab {e}"
    return None


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = (pathlib.Path(p) for p in sys.argv[1:3])
    files = sorted(p.relative_to(a) for p in a.rglob("*.npy"))
    others = sorted(p.relative_to(b) for p in b.rglob("*.npy"))
    bad = [f"{p}: only in one tree" for p in sorted(set(files) ^ set(others))]
    for rel in files:
        if rel in set(others):
            why = differs(a, b, rel)
            if why:
                bad.append(f"{rel}: {why}")
    for line in bad:
        print(line)
    print(f"compare-dumps: {len(files)} arrays compared, {len(bad)} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
