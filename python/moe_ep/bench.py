"""python3 -m moe_ep.bench: moe_ep.deep_ep beside the C++ tool, measured in the same run.

The DeepSeek-V3 shape (hidden 7168, 256 experts, top-8; FP8 dispatch with per-128 scales, BF16
combine) at 4096 and 128 tokens per rank, through ``moe_ep.deep_ep.ElasticBuffer`` on N processes
over a gloo group (moe-ep's host transport), and through ``moe-ep bench --api v2 --transport mpi``
on N MPI processes (the same host transport, and the MPI transport for comparison). The Python
side runs twice: with inputs from ``moe_ep.empty`` (as the tool allocates its own) and with inputs
torch allocated (what engines pass). Time = median over iterations of the slowest rank, each call
after a barrier (the tool's definition). Printed: the times, throughput ratio = C++ time / Python
time, the time Python adds per call = Python time - C++ time, and torch / empty = the time with
moe_ep.empty inputs / the time with torch-allocated inputs.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def _fp8_inputs(tokens, seed, rank):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn(tokens, HIDDEN, generator=g) * 0.5).clamp(-448, 448)
    # Any E4M3 bytes will do for a bandwidth measurement: the library copies them verbatim.
    x_fp8 = torch.randint(0, 0x7e, (tokens, HIDDEN), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scales = torch.rand(tokens, HIDDEN // 128, generator=g) + 0.5
    idx = torch.rand(tokens, EXPERTS, generator=g).topk(TOPK, dim=1).indices.to(torch.int64)
    weights = torch.rand(tokens, TOPK, generator=g)
    return x_fp8, scales, idx, weights, x


def _worker(rank, world, init_file, shapes, iters, shared_inputs, queue):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from moe_ep import deep_ep
        import moe_ep

        group = moe_ep.resolve_group(dist.group.WORLD)
        out = {}
        with torch.inference_mode():
            for tokens in shapes:
                buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=tokens, hidden=HIDDEN,
                                            num_topk=TOPK, use_fp8_dispatch=True)
                x_fp8, scales, idx, weights, _ = _fp8_inputs(tokens, 1, rank)
                if shared_inputs:
                    # In moe-ep's memory, as the C++ tool's inputs are: node peers read them in place.
                    x_fp8 = moe_ep.empty_like(x_fp8).copy_(x_fp8)
                    scales = moe_ep.empty_like(scales).copy_(scales)
                times = {"dispatch": [], "combine": [], "maps": 0, "dispatch_layer": [], "combine_layer": []}
                native = moe_ep._C.last_native_seconds
                # As the tool does: one dispatch makes the handle and the combine input; then each
                # operation is timed on its own, every call after a barrier (outputs are released
                # before the barrier, outside the timing).
                first = buf.dispatch((x_fp8, scales), topk_idx=idx, topk_weights=weights, num_experts=EXPERTS)
                handle = first[3]
                rows = first[0][0].shape[0]
                combine_x = (moe_ep.zeros if shared_inputs else torch.zeros)(rows, HIDDEN, dtype=torch.bfloat16)
                calls = {
                    "dispatch": lambda: buf.dispatch((x_fp8, scales), topk_idx=idx, topk_weights=weights,
                                                     num_experts=EXPERTS),
                    "combine": lambda: buf.combine(combine_x, handle),  # no weights to return, as the tool
                }
                maps = lambda: moe_ep._C.allocator_stats()["num_maps"]
                for op, call in calls.items():
                    result = None
                    for it in range(iters[tokens] + 2):  # two warm-up iterations
                        result = None
                        if it == 2:
                            maps_before = maps()
                        group.barrier()
                        t0 = time.perf_counter()
                        result = call()
                        t1 = time.perf_counter()
                        if it >= 2:
                            times[op].append(t1 - t0)
                            # What the Python layer adds: the call's time outside the C++ buffer call.
                            times[op + "_layer"].append((t1 - t0) - native())
                    result = None
                    times["maps"] += maps() - maps_before  # mappings made during the timed iterations
                out[tokens] = times
                buf = None
        queue.put((rank, out, None))
    except BaseException:
        import traceback
        queue.put((rank, None, traceback.format_exc()))


def _python_times(world, shapes, iters, shared_inputs, timeout):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world, init, shapes, iters, shared_inputs, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, out, err = queue.get(timeout=timeout)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            results[rank] = out
        for p in procs:
            p.join(timeout=30)
    # Slowest rank per iteration, then the median.
    summary = {}
    for tokens in shapes:
        for op in ("dispatch", "combine"):
            per_iter = [max(results[r][tokens][op][i] for r in results) for i in range(iters[tokens])]
            per_iter.sort()
            summary[(tokens, op)] = per_iter[len(per_iter) // 2]
        summary[(tokens, "maps")] = max(results[r][tokens]["maps"] for r in results)
        for op in ("dispatch_layer", "combine_layer"):
            every = sorted(v for r in results for v in results[r][tokens][op])
            summary[(tokens, op)] = every[len(every) // 2]
    return summary


def _tool_times(tool, transport, world, shapes, iters, timeout):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun is not on PATH (Open MPI: apt-get install openmpi-bin)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_btl_vader_single_copy_mechanism="none")
        cmd = [mpirun, "-np", str(world), "--oversubscribe", tool, "bench", "--api", "v2", "--transport", transport,
               "--prefill-tokens", str(shapes[0]), "--decode-tokens", str(shapes[1]),
               "--prefill-iters", str(iters[shapes[0]]), "--decode-iters", str(iters[shapes[1]]), "--json", out]
        subprocess.run(cmd, check=True, env=env, timeout=timeout, stdout=subprocess.DEVNULL)
        with open(out) as f:
            data = json.load(f)
    summary = {}
    for r in data["results"]:
        if r["operation"] in ("dispatch", "combine"):
            summary[(r["tokens_per_rank"], r["operation"])] = r["seconds"]
    return summary


def _find_tool():
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.environ.get("MOE_EP_TOOL"), os.path.join(here, "..", "..", "moe-ep"), shutil.which("moe-ep")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m moe_ep.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="processes (default 8)")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-iters", type=int, default=5)
    p.add_argument("--decode-iters", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; the best is kept (default 2)")
    p.add_argument("--tool", help="the moe-ep executable (default: the build tree's, MOE_EP_TOOL, or PATH)")
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args(argv)
    tool = a.tool or _find_tool()
    if tool is None:
        p.error("the moe-ep executable was not found: pass --tool or set MOE_EP_TOOL")
    shapes = [a.prefill_tokens, a.decode_tokens]
    iters = {a.prefill_tokens: a.prefill_iters, a.decode_tokens: a.decode_iters}
    print(f"moe_ep.bench: DeepSeek-V3 shape (hidden {HIDDEN}, {EXPERTS} experts, top-{TOPK}), FP8 dispatch, BF16 "
          f"combine, {a.ranks} ranks; V2 ElasticBuffer", flush=True)
    # The two sides alternate, --repeats times each; each keeps its best run per operation (the
    # least disturbed by the rest of the machine).
    runs = {"host": [], "mpi": [], "python": [], "torch": []}
    for _ in range(a.repeats):
        runs["host"].append(_tool_times(tool, "host", a.ranks, shapes, iters, a.timeout))
        runs["python"].append(_python_times(a.ranks, shapes, iters, True, a.timeout))
        runs["torch"].append(_python_times(a.ranks, shapes, iters, False, a.timeout))
        runs["mpi"].append(_tool_times(tool, "mpi", a.ranks, shapes, iters, a.timeout))
    best = lambda side: {key: (max if key[1] == "maps" else min)(r[key] for r in runs[side]) for key in runs[side][0]}
    cpp, cpp_mpi, py, py_torch = best("host"), best("mpi"), best("python"), best("torch")
    print(f"{'tokens/rank':>11}  {'operation':9}  {'C++ host (us)':>13}  {'Python (us)':>11}  {'ratio':>6}  "
          f"{'added (us)':>10}  {'C++ MPI (us)':>12}  {'torch inputs (us)':>17}  {'torch / empty':>13}")
    for tokens in shapes:
        for op in ("dispatch", "combine"):
            c, q, m, t = cpp[(tokens, op)], py[(tokens, op)], cpp_mpi[(tokens, op)], py_torch[(tokens, op)]
            print(f"{tokens:>11}  {op:9}  {c * 1e6:13.1f}  {q * 1e6:11.1f}  {c / q:6.2f}  {(q - c) * 1e6:10.1f}  "
                  f"{m * 1e6:12.1f}  {t * 1e6:17.1f}  {q / t:13.2f}")
    print("Python layer per call (median over ranks and iterations of the call's time minus the time spent in "
          "the C++ buffer call: argument conversion, wrappers, outputs to torch):")
    for tokens in shapes:
        print(f"  {tokens:>5} tokens/rank: dispatch {py[(tokens, 'dispatch_layer')] * 1e6:.1f} us, combine "
              f"{py[(tokens, 'combine_layer')] * 1e6:.1f} us")
    for tokens in shapes:
        print(f"steady state at {tokens} tokens/rank: {py[(tokens, 'maps')]} new mappings by moe-ep's allocator over "
              f"the timed iterations (most on one rank; outputs come from its cache)")
    print(f"time: median over iterations of the slowest rank, each call after a barrier; the best of {a.repeats} "
          "alternating runs of each side.")
    print("ratio = C++ time / Python time (throughput of moe_ep.deep_ep relative to the C++ tool; target >= 0.95 at "
          f"{a.prefill_tokens} tokens); added = Python time - C++ time (target <= 30 us at {a.decode_tokens} tokens; "
          "with more ranks than cores the run-to-run noise is larger than that: the line above measures the layer "
          "directly).")
    print(f"C++ host: mpirun -np {a.ranks} {tool} bench --api v2 --transport host (the same shared-memory host "
          f"transport; MPI only starts the processes); C++ MPI: the same with --transport mpi. Python: {a.ranks} "
          f"torch.multiprocessing processes over a gloo group, moe_ep.deep_ep.ElasticBuffer, inputs from moe_ep.empty "
          f"(as the tool allocates its own); torch inputs: the same calls with x, scales and the combine input "
          f"allocated by torch (torch / empty = Python time / torch-inputs time; target >= 0.9 at "
          f"{a.prefill_tokens} tokens).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
