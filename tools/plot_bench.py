#!/usr/bin/env python3
"""Plots of a `moe-ep bench --sweep` record: bandwidth and time against the swept parameter.

Usage: .venv/bin/python tools/plot_bench.py SWEEP.json [--out DIR] [--title TEXT]

Writes DIR/sweep-<parameter>-bandwidth.png (logical GB/s of each operation, the MPI_Alltoallv
baseline's when the sweep ran under mpirun, and the memcpy ceiling measured beside each point)
and DIR/sweep-<parameter>-time.png (median time of the slowest rank per call, with the one-copy
floor of dispatch: its logical bytes at the memcpy ceiling). Needs matplotlib (Debian:
python3-matplotlib). Prints the paths it wrote.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"tokens": "tokens per rank", "ranks": "ranks", "hidden": "hidden size"}


def series(points):
    """{operation: ([x], [gbs], [seconds], baseline)} in the order operations first appear."""
    out = {}
    for p in points:
        for r in p["results"]:
            xs, gbs, secs, _ = out.setdefault(r["operation"], ([], [], [], r.get("baseline", False)))
            xs.append(p["value"])
            gbs.append(r["gbs"])
            secs.append(r["seconds"])
    return out


def log_x(ax, xs):
    """A base-2 x axis with the swept values as plain tick labels."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.minorticks_off()


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", help="the JSON written by moe-ep bench --sweep")
    ap.add_argument("--out", default=".", help="folder for the PNG files (default: .)")
    ap.add_argument("--title", default=None, help="title prefix (default: from the record)")
    a = ap.parse_args(argv)
    with open(a.record) as f:
        rec = json.load(f)
    if "sweep" not in rec or not rec.get("points"):
        sys.exit(f"plot_bench: {a.record} is not a sweep record (run moe-ep bench --sweep KEY=LIST --json FILE)")
    key = rec["sweep"]["parameter"]
    points = rec["points"]
    xs = [p["value"] for p in points]
    ceiling = [p["memcpy_gbs"] for p in points]
    ops = series(points)
    title = a.title or (f"moe-ep {rec['version']} {rec['api']}: {rec['launch']}, hidden {rec['hidden']}, "
                        f"{rec['experts']} experts, top-{rec['topk']} ({rec['host']}, {rec['cores']} cores)")
    os.makedirs(a.out, exist_ok=True)
    written = []

    def save(fig, ax, ylabel, name):
        log_x(ax, xs)
        ax.set_xlabel(LABELS.get(key, key))
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = os.path.join(a.out, f"sweep-{key}-{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (x, gbs, _, baseline) in ops.items():
        ax.plot(x, gbs, marker="o", linestyle="--" if baseline else "-", label=name)
    ax.plot(xs, ceiling, color="black", linestyle=":", marker="x", label="memcpy ceiling (same threads)")
    save(fig, ax, "logical GB/s (all ranks)", "bandwidth")

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (x, _, secs, baseline) in ops.items():
        ax.plot(x, [s * 1e3 for s in secs], marker="o", linestyle="--" if baseline else "-", label=name)
    # One copy of dispatch's logical bytes at the ceiling: the least time any dispatch can take.
    first = next(iter(ops))
    floor = []
    for p in points:
        r = next(r for r in p["results"] if r["operation"] == first)
        floor.append(r["bytes"] / (p["memcpy_gbs"] * 1e9) * 1e3)
    ax.plot(xs, floor, color="black", linestyle=":", marker="x", label=f"{first}: one copy at the memcpy ceiling")
    ax.set_yscale("log")
    save(fig, ax, "time per call (ms, slowest rank, median)", "time")
    for p in written:
        print(p)


if __name__ == "__main__":
    main(sys.argv[1:])
