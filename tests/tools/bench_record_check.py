#!/usr/bin/env python3
"""Checks of `moe-ep bench` records (its --json file, --sweep's JSON and CSV, tools/plot_bench.py).

Usage: bench_record_check.py single MOE_EP VERSION
       bench_record_check.py sweep MOE_EP PLOT_SCRIPT
       bench_record_check.py errors MOE_EP
       bench_record_check.py mpi_sweep SWEEP.json   (a sweep run under mpirun --transport mpi)

Every expectation is computed here from the arguments given and from the machine (host name,
cores, /proc/cpuinfo), never taken from moe-ep's own output. No timing is judged: times are only
checked to be positive and consistent with the other fields of the same record.
"""

import csv
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import tempfile

SHAPE = ["--hidden", "256", "--experts", "16", "--topk", "4", "--ranks", "4"]


def fail(msg):
    sys.exit(f"FAIL: {msg}")


def check(cond, msg):
    if not cond:
        fail(msg)


def run(argv, cwd):
    p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
    return p


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def check_header(rec, argv, version):
    check(rec["version"] == version, f"version {rec['version']!r}, expected {version!r}")
    check(rec["host"] == socket.gethostname(), f"host {rec['host']!r}, expected {socket.gethostname()!r}")
    check(rec["cores"] == os.cpu_count(), f"cores {rec['cores']}, expected {os.cpu_count()}")
    check(rec["cpu_model"] == cpu_model(), f"cpu_model {rec['cpu_model']!r}, expected {cpu_model()!r}")
    check(rec["command_line"][1:] == argv[1:], f"command_line {rec['command_line']}, expected {argv}")
    date = datetime.datetime.strptime(rec["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    now = datetime.datetime.now(datetime.timezone.utc)
    check(abs((now - date).total_seconds()) < 86400, f"date {rec['date']} is not today (UTC)")
    for k, v in (("hidden", 256), ("experts", 16), ("topk", 4), ("ranks", 4), ("transport", "local")):
        check(rec[k] == v, f"{k} is {rec[k]!r}, expected {v!r}")


H, K, RANKS = 256, 4, 4


def check_floor(r, tokens):
    """The least traffic of the operation (from the shape given, not from moe-ep's formulas) and its
    floor priced at the bandwidths recorded beside it."""
    op = r["operation"]
    if "dispatch" in op:
        # Every received row written once: the logical bytes; every routed token read once (at most
        # one per received row, at most the tokens given).
        check(r["write_bytes"] == r["bytes"], f"{op}: write_bytes {r['write_bytes']} != logical bytes {r['bytes']}")
        # FP8 payload and scales, or BF16 payload; int64 ids, float32 weights
        row = 2 * H + 12 * K if "BF16" in op else H + 4 * (H // 128) + 12 * K
        check(0 < r["read_bytes"] <= min(r["write_bytes"], tokens * RANKS * row), f"{op}: read_bytes {r['read_bytes']}")
        check(r["read_bytes"] % row == 0, f"{op}: read_bytes {r['read_bytes']} is not whole tokens of {row} B")
    else:
        # Every returned row read once (hidden x 2 B of the logical row's 2H + 4k), every token written once.
        check(close(r["read_bytes"], r["bytes"] * 2 * H / (2 * H + 4 * K)), f"{op}: read_bytes {r['read_bytes']}")
        check(r["write_bytes"] == tokens * RANKS * 2 * H, f"{op}: write_bytes {r['write_bytes']}")
    copy, read, write = r["streaming_copy_gbs"] * 1e9, r["read_gbs"] * 1e9, r["write_gbs"] * 1e9
    if read > copy > 0 and write >= 0:
        # A byte written: the cheaper of the copy's time less its reads and a write-only stream.
        written = min(1 / copy - 1 / read, 1 / write) if write > 0 else 1 / copy - 1 / read
        floor = r["read_bytes"] / read + r["write_bytes"] * written
        check(close(r["floor_seconds"], floor), f"{op}: floor {r['floor_seconds']}, expected {floor}")
        check(close(r["efficiency"], floor / r["seconds"]), f"{op}: efficiency != floor / seconds")
    else:
        check(r["floor_seconds"] is None and r["efficiency"] is None, f"{op}: a floor without usable bandwidths")
    check(r["barrier_seconds"] > 0 and close(r["x_barrier"], r["seconds"] / r["barrier_seconds"]),
          f"{op}: x_barrier != seconds / barrier_seconds")


def check_result(r, iterations, memcpy_gbs, tokens):
    check_floor(r, tokens)
    samples = r["samples_seconds"]
    check(len(samples) == iterations, f"{r['operation']}: {len(samples)} samples, expected {iterations}")
    check(all(s > 0 for s in samples), f"{r['operation']}: samples {samples}")
    check(r["seconds"] == sorted(samples)[len(samples) // 2], f"{r['operation']}: seconds is not the median of its samples")
    check(close(r["gbs"], r["bytes"] / r["seconds"] / 1e9), f"{r['operation']}: gbs != bytes / seconds")
    check(close(r["ratio"], r["gbs"] / memcpy_gbs), f"{r['operation']}: ratio != gbs / memcpy_gbs")
    # In-process there is no MPI_Alltoallv baseline: the speed-up does not apply.
    check(r["speedup_vs_alltoallv"] is None, f"{r['operation']}: speedup {r['speedup_vs_alltoallv']}, expected null")


def single(moe_ep, version):
    with tempfile.TemporaryDirectory() as d:
        argv = [moe_ep, "bench", *SHAPE, "--prefill-tokens", "32", "--decode-tokens", "8", "--prefill-iters", "3",
                "--decode-iters", "2", "--payloads", "--json", "out.json"]
        run(argv, d)
        with open(os.path.join(d, "out.json")) as f:
            rec = json.load(f)
    check_header(rec, argv, version)
    shapes = {}
    for r in rec["results"]:
        shapes.setdefault(r["shape"], []).append(r["operation"])
        check_result(r, 3 if r["shape"] == "prefill" else 2, rec["memcpy_gbs"], 32 if r["shape"] == "prefill" else 8)
    ops = ["dispatch", "cached dispatch", "combine", "dispatch (BF16)"]
    check(shapes == {"prefill": ops, "decode": ops}, f"operations {shapes}")
    print("bench record: PASS")


def sweep(moe_ep, plot):
    with tempfile.TemporaryDirectory() as d:
        check_tokens_sweep(moe_ep, d)
        check_ranks_and_experts_sweeps(moe_ep, d)
        check_plots(plot, d)
    print("sweep record and plots: PASS")


def check_tokens_sweep(moe_ep, d):
    """A tokens sweep in directory d: its JSON record (s.json) and CSV rows (s.csv)."""
    argv = [moe_ep, "bench", *SHAPE, "--prefill-iters", "2", "--sweep", "tokens=8,16,...,64", "--json", "s.json",
            "--csv", "s.csv"]
    run(argv, d)
    with open(os.path.join(d, "s.json")) as f:
        rec = json.load(f)
    with open(os.path.join(d, "s.csv")) as f:
        rows = list(csv.DictReader(f))
    check_header(rec, argv, rec["version"])
    values = [8, 16, 32, 64]  # 8, 16, ... continues by 16 / 8 = 2 up to 64
    check(rec["sweep"] == {"parameter": "tokens", "values": values}, f"sweep {rec['sweep']}")
    check([p["value"] for p in rec["points"]] == values, "points are not the swept values")
    ops = ["dispatch", "cached dispatch", "combine"]
    check(len(rows) == len(values) * len(ops), f"{len(rows)} CSV rows, expected {len(values) * len(ops)}")
    i = 0
    for p in rec["points"]:
        check(p["tokens_per_rank"] == p["value"] and p["hidden"] == 256 and p["ranks"] == 4, f"point {p['value']}")
        check([r["operation"] for r in p["results"]] == ops, f"point {p['value']}: operations")
        for r in p["results"]:
            check_result(r, 2, p["memcpy_gbs"], p["value"])
            row = rows[i]
            i += 1
            check(row["parameter"] == "tokens" and int(row["value"]) == p["value"] and row["operation"] == r["operation"],
                  f"CSV row {i}: {row}")
            check(math.isclose(float(row["seconds"]), r["seconds"], rel_tol=1e-6), f"CSV row {i}: seconds")
            check(float(row["bytes"]) == r["bytes"], f"CSV row {i}: bytes")
            check(row["speedup_vs_alltoallv"] == "", f"CSV row {i}: a speed-up without a baseline")
    # Dispatch's logical bytes grow with the tokens: the same routing scaled (skewed router,
    # so only monotonic, not proportional).
    dispatch = [p["results"][0]["bytes"] for p in rec["points"]]
    check(all(a < b for a, b in zip(dispatch, dispatch[1:])), f"dispatch bytes {dispatch} do not grow with tokens")


def check_ranks_and_experts_sweeps(moe_ep, d):
    """Sweeps over ranks and experts in directory d, with their default record names."""
    # ranks: in-process, a new group per point.
    argv = [moe_ep, "bench", *SHAPE, "--prefill-iters", "1", "--prefill-tokens", "16", "--sweep", "ranks=2,4,8"]
    run(argv, d)
    with open(os.path.join(d, "sweep-ranks.json")) as f:
        ranks = json.load(f)
    check([p["ranks"] for p in ranks["points"]] == [2, 4, 8], "ranks sweep: points' ranks")
    check(os.path.exists(os.path.join(d, "sweep-ranks.csv")), "ranks sweep: default CSV missing")

    # experts: the same ranks and top-k, more experts per rank at each point.
    argv = [moe_ep, "bench", *SHAPE, "--prefill-iters", "1", "--prefill-tokens", "16", "--sweep", "experts=16,32,...,64"]
    run(argv, d)
    with open(os.path.join(d, "sweep-experts.json")) as f:
        experts = json.load(f)
    check(experts["sweep"] == {"parameter": "experts", "values": [16, 32, 64]}, f"experts sweep {experts['sweep']}")
    check([p["experts"] for p in experts["points"]] == [16, 32, 64], "experts sweep: points' experts")


def check_plots(plot, d):
    """tools/plot_bench.py on the tokens sweep of directory d (PNG files); it refuses a file that is
    not a sweep record."""
    out = os.path.join(d, "plots")
    p = subprocess.run([sys.executable, plot, os.path.join(d, "s.json"), "--out", out], capture_output=True, text=True)
    check(p.returncode == 0, f"plot_bench.py exited {p.returncode}: {p.stderr.strip()}")
    for name in ("sweep-tokens-bandwidth.png", "sweep-tokens-time.png", "sweep-tokens-efficiency.png"):
        path = os.path.join(out, name)
        check(os.path.exists(path), f"{name} not written")
        with open(path, "rb") as f:
            head = f.read(24)
        check(head[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG")
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        check(width > 100 and height > 100, f"{name} is {width}x{height}")
    p = subprocess.run([sys.executable, plot, os.path.join(d, "sweep-ranks.csv")], capture_output=True, text=True)
    check(p.returncode != 0, "plot_bench.py accepted a file that is not a sweep record")


def mpi_sweep(path):
    with open(path) as f:
        rec = json.load(f)
    check(rec["transport"] == "mpi", f"transport {rec['transport']}")
    for p in rec["points"]:
        by_name = {r["operation"]: r for r in p["results"]}
        # Every rank of this job shares one host: the shared-window baseline runs beside Alltoallv.
        pairs = {"dispatch": ["alltoallv dispatch", "shared-window dispatch"],
                 "combine": ["alltoallv combine", "shared-window combine"]}
        check(all(b in by_name for bs in pairs.values() for b in bs), f"point {p['value']}: no baseline rows")
        for r in p["results"]:
            if r["baseline"] or r["operation"] not in pairs:
                # The baselines themselves and cached dispatch (no baseline does a replay).
                check(r["speedup_vs_alltoallv"] is None, f"{r['operation']}: speed-up {r['speedup_vs_alltoallv']}")
            else:
                best = min(by_name[b]["seconds"] for b in pairs[r["operation"]])
                check(close(r["speedup_vs_alltoallv"], best / r["seconds"]),
                      f"{r['operation']}: speed-up != best baseline / ours")
    print("MPI sweep record: PASS")


def errors(moe_ep):
    cases = [
        (["--sweep", "seed=1,2"], "--sweep is 'seed=1,2', expected tokens=LIST, ranks=LIST, hidden=LIST or experts=LIST"),
        (["--sweep", "experts=16,18"], "--sweep experts: 18 experts must be a multiple of the 4 ranks"),
        (["--sweep", "experts=2,4,...,16"], "--sweep experts: 2 experts must be a multiple of the 4 ranks and at least --topk (4)"),
        (["--dispatcher", "--sweep", "tokens=8,16"], "--dispatcher and --sweep: pick one"),
        (["--sweep", "tokens=16,x"], "--sweep tokens: 'x' is not a positive integer"),
        (["--sweep", "tokens=16,24,...,96"], "the second value (24) must be a multiple of the first (16)"),
        (["--sweep", "tokens=16,32,...,100"], "100 is not in the series 16,32,..."),
        (["--sweep", "tokens=32,16"], "values must increase (16 after 32)"),
        (["--sweep", "hidden=256,300"], "--sweep hidden: 300 is not a multiple of 128"),
        (["--sweep", "ranks=2,3"], "--sweep ranks: 3 ranks must divide --experts (16)"),
        (["--csv", "x.csv"], "--csv needs --sweep"),
    ]
    with tempfile.TemporaryDirectory() as d:
        for extra, message in cases:
            p = subprocess.run([moe_ep, "bench", *SHAPE, *extra], cwd=d, capture_output=True, text=True)
            check(p.returncode == 2, f"{extra}: exit {p.returncode}, expected 2 ({p.stderr.strip()})")
            check(message in p.stderr, f"{extra}: stderr {p.stderr.strip()!r} lacks {message!r}")
            check(p.stdout == "", f"{extra}: wrote to stdout: {p.stdout!r}")
            check(not os.listdir(d), f"{extra}: left files {os.listdir(d)}")
    print("bench usage errors: PASS")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    sys.argv[2:] = [os.path.abspath(a) if os.path.exists(a) else a for a in sys.argv[2:]]
    if mode == "single" and len(sys.argv) == 4:
        single(sys.argv[2], sys.argv[3])
    elif mode == "sweep" and len(sys.argv) == 4:
        sweep(sys.argv[2], sys.argv[3])
    elif mode == "mpi_sweep" and len(sys.argv) == 3:
        mpi_sweep(sys.argv[2])
    elif mode == "errors" and len(sys.argv) == 3:
        errors(sys.argv[2])
    else:
        sys.exit(__doc__)
