#!/usr/bin/env python3
"""Plots of `moe-ep bench --sweep` records: bandwidth, time and efficiency against the swept parameter.

Usage: .venv/bin/python tools/plot_bench.py SWEEP.json [MORE.json ...] [--out DIR] [--title TEXT]

For the first record: DIR/sweep-<parameter>-bandwidth.png (logical GB/s of each operation, the
baselines' when the sweep ran under mpirun, and the memcpy ceiling measured beside each point) and
DIR/sweep-<parameter>-time.png (median time of the slowest rank per call, with the floor of
dispatch: its least traffic at the memory bandwidth measured beside each point). For all records
together (one per transport, the same sweep): DIR/sweep-<parameter>-efficiency.png, the
efficiency (floor / time) of every operation of every record on one picture, labelled by the
record's transport. Needs matplotlib. Prints the paths it wrote.
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


def efficiency_series(points):
    """{operation: ([x], [efficiency], baseline)}, points without a floor left out."""
    out = {}
    for p in points:
        for r in p["results"]:
            if r.get("efficiency") is None:
                continue
            xs, eff, _ = out.setdefault(r["operation"], ([], [], r.get("baseline", False)))
            xs.append(p["value"])
            eff.append(r["efficiency"])
    return out


def load(path):
    with open(path) as f:
        rec = json.load(f)
    if "sweep" not in rec or not rec.get("points"):
        sys.exit(f"plot_bench: {path} is not a sweep record (run moe-ep bench --sweep KEY=LIST --json FILE)")
    return rec


def log_x(ax, xs):
    """A base-2 x axis with the swept values as plain tick labels."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.minorticks_off()


def plot_bandwidth(ops, xs, ceiling, save):
    """Logical GB/s of every operation beside the memcpy ceiling of the same threads."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (x, gbs, _, baseline) in ops.items():
        ax.plot(x, gbs, marker="o", linestyle="--" if baseline else "-", label=name)
    ax.plot(xs, ceiling, color="black", linestyle=":", marker="x", label="memcpy ceiling (same threads)")
    save(fig, ax, "logical GB/s (all ranks)", "bandwidth")


def plot_time(ops, points, xs, save):
    """Time per call of every operation, and the floor of the first one."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (x, _, secs, baseline) in ops.items():
        ax.plot(x, [s * 1e3 for s in secs], marker="o", linestyle="--" if baseline else "-", label=name)
    # The least time any dispatch can take: its least traffic at the bandwidth of the same threads.
    first = next(iter(ops))
    floor = []
    for p in points:
        r = next(r for r in p["results"] if r["operation"] == first)
        floor.append(r["floor_seconds"] * 1e3 if r.get("floor_seconds") is not None else float("nan"))
    ax.plot(xs, floor, color="black", linestyle=":", marker="x", label=f"{first}: its floor (least traffic, measured bandwidth)")
    ax.set_yscale("log")
    save(fig, ax, "time per call (ms, slowest rank, median)", "time")


def plot_efficiency(records, save):
    """Efficiency (floor / time) of moe-ep's operations, every record's transport on one picture."""
    fig, ax = plt.subplots(figsize=(8, 6))
    for r_ in records:
        for name, (x, eff, baseline) in efficiency_series(r_["points"]).items():
            if not baseline:  # moe-ep's operations; the baselines' are in each record
                ax.plot(x, eff, marker="o", label=f"{r_['transport']}: {name}")
    ax.axhline(1.0, color="black", linestyle=":", label="floor: least traffic at the measured bandwidth")
    save(fig, ax, "efficiency = floor / time", "efficiency")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", help="the JSON written by moe-ep bench --sweep")
    ap.add_argument("more", nargs="*", help="more records of the same sweep (other transports), for the efficiency plot")
    ap.add_argument("--out", default=".", help="folder for the PNG files (default: .)")
    ap.add_argument("--title", default=None, help="title prefix (default: from the record)")
    a = ap.parse_args(argv)
    records = [load(path) for path in [a.record, *a.more]]
    rec = records[0]
    if any(r["sweep"]["parameter"] != rec["sweep"]["parameter"] for r in records):
        sys.exit("plot_bench: the records sweep different parameters")
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
        if len(ax.get_lines()) > 6:  # many series: the legend below the axes, not over the lines
            ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
        else:
            ax.legend(fontsize=8)
        path = os.path.join(a.out, f"sweep-{key}-{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    plot_bandwidth(ops, xs, ceiling, save)
    plot_time(ops, points, xs, save)
    if len(records) > 1:
        title = (f"moe-ep {rec['version']} {rec['api']}: {', '.join(r_['transport'] for r_ in records)}, "
                 f"hidden {rec['hidden']}, {rec['experts']} experts, top-{rec['topk']} ({rec['host']}, {rec['cores']} cores)")
    plot_efficiency(records, save)
    for p in written:
        print(p)


if __name__ == "__main__":
    main(sys.argv[1:])
