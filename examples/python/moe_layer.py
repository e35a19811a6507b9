#!/usr/bin/env python3
"""An engine-shaped MoE layer on moe-ep: N processes over a gloo group, through the token dispatcher.

Each process holds its own tokens. The layer routes them (a linear router, softmax, top-k,
renormalised weights), dispatches them to the ranks that own their experts, runs each expert
(a SwiGLU MLP in torch) on the rows it received, and combines the results back. It runs with V1
(the default) and with MOE_EP_USE_V2=1, in normal mode (a prefill batch) and in low-latency mode
(a decode batch), and checks every output against the same layer computed in one process with
plain torch.

    PYTHONPATH=build/python .venv/bin/python examples/python/moe_layer.py --ranks 4

(.venv is the project's Python environment, made by scripts/python-env.sh.)
"""

import argparse
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def layer_weights(hidden, experts, ffn, seed):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(hidden, experts, generator=g) / hidden ** 0.5
    w_gate = torch.randn(experts, hidden, ffn, generator=g) / hidden ** 0.5
    w_up = torch.randn(experts, hidden, ffn, generator=g) / hidden ** 0.5
    w_down = torch.randn(experts, ffn, hidden, generator=g) / ffn ** 0.5
    return router, w_gate, w_up, w_down


def expert_mlp(x, e, w_gate, w_up, w_down):
    """Expert e on rows x (any dtype): float32 SwiGLU."""
    x = x.float()
    return (torch.nn.functional.silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]


def route(x, router, topk):
    probs = torch.softmax(x.float() @ router, dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx.to(torch.int64), (weights / weights.sum(-1, keepdim=True)).float()


def reference_layer(x, idx, weights, w):
    """The whole layer in one process: out[t] = sum_j weights[t, j] * expert_{idx[t, j]}(x[t])."""
    out = torch.zeros(x.shape[0], x.shape[1])
    terms = torch.zeros_like(out)  # sum_j |w_j * y_j|, for the rounding bound
    for j in range(idx.shape[1]):
        for e in idx[:, j].unique().tolist():
            rows = (idx[:, j] == e).nonzero().flatten()
            y = weights[rows, j, None] * expert_mlp(x[rows], e, *w)
            out[rows] += y
            terms[rows] += y.abs()
    return out, terms


def run_experts(out, rank, num_local, w):
    """The expert computation each output format asks for (docs/dispatcher.md §5)."""
    x = out.hidden_states
    if out.format == "normal":
        # One row per received token: its weighted sum over the local experts it chose.
        y = torch.zeros(x.shape[0], x.shape[1])
        for j in range(out.topk_ids.shape[1]):
            for le in out.topk_ids[:, j].unique().tolist():
                if le < 0:
                    continue
                rows = (out.topk_ids[:, j] == le).nonzero().flatten()
                y[rows] += out.topk_weights[rows, j, None] * expert_mlp(x[rows], rank * num_local + le, *w)
        return y.to(torch.bfloat16)
    if out.format == "low_latency":
        # Per local expert, its first masked_m rows; unweighted (combine applies the weights).
        y = torch.zeros_like(x)
        for le in range(num_local):
            m = int(out.masked_m[le])
            y[le, :m] = expert_mlp(x[le, :m], rank * num_local + le, *w).to(torch.bfloat16)
        return y
    if out.format == "v2_expanded":
        # One row per (token, local expert), grouped by expert: weighted rows.
        y = torch.zeros_like(x)
        start = 0
        for le, aligned in enumerate(out.num_recv_tokens_per_expert):
            m = int(out.masked_m[le])
            rows = slice(start, start + m)
            y[rows] = (out.topk_weights[rows, None] * expert_mlp(x[rows], rank * num_local + le, *w)).to(torch.bfloat16)
            start += aligned
        return y
    raise RuntimeError(f"unknown output format {out.format}")


def find_package():
    """Makes `import moe_ep` work from a source checkout: the build tree's package, if not installed."""
    try:
        import moe_ep  # noqa: F401
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sys.path.insert(0, os.path.join(root, "build", "python"))


def worker(rank, args, init_file, results):
    try:
        find_package()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks)
        import moe_ep

        w = layer_weights(args.hidden, args.experts, args.ffn, seed=1234)
        router, weights = w[0], w[1:]
        num_local = args.experts // args.ranks
        cache = moe_ep.BufferCache(dist.group.WORLD)
        lines = []
        with torch.inference_mode():
            for generation in args.generations:
                os.environ["MOE_EP_USE_V2"] = "1" if generation == "V2" else "0"
                dispatcher = moe_ep.TokenDispatcher(cache, hidden=args.hidden, num_experts=args.experts,
                                                    num_topk=args.topk, mode="auto",
                                                    num_max_dispatch_tokens_per_rank=args.tokens)
                for kind in ("prefill", "decode"):
                    g = torch.Generator().manual_seed(1000 * rank + (0 if kind == "prefill" else 1))
                    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16)
                    idx, topk_w = route(x, router, args.topk)
                    out = dispatcher.dispatch(x, idx, topk_w, kind=kind)
                    y = run_experts(out, rank, num_local, weights)
                    combined = dispatcher.combine(y)
                    ref, terms = reference_layer(x, idx, topk_w, weights)
                    # BF16 roundings of the expert rows and of the result: a few 2^-8 relative steps.
                    err = (combined.float() - ref).abs()
                    bound = 2.0 ** -6 * terms + 2.0 ** -8 * ref.abs() + 1e-6
                    ok = bool((err <= bound).all())
                    lines.append(f"rank {rank} {generation} {kind:7s} mode {out.mode:11s} format {out.format:11s} "
                                 f"max |error| {err.max().item():.2e} (bound {bound.min().item():.1e}.."
                                 f"{bound.max().item():.1e}) {'ok' if ok else 'MISMATCH'}")
                    if not ok:
                        results.put((rank, False, "\n".join(lines)))
                        return
                del dispatcher
        cache.destroy()
        results.put((rank, True, "\n".join(lines)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank (default 64)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024; a multiple of 512)")
    p.add_argument("--experts", type=int, default=32, help="experts (default 32; a multiple of --ranks)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--ffn", type=int, default=256, help="expert MLP width (default 256)")
    p.add_argument("--generation", choices=["V1", "V2", "both"], default="both",
                   help="V1 (MOE_EP_USE_V2=0), V2 (MOE_EP_USE_V2=1) or both (default)")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the processes (default 300)")
    args = p.parse_args()
    if args.ranks < 1 or args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a positive multiple of --ranks {args.ranks}")
    args.generations = ["V1", "V2"] if args.generation == "both" else [args.generation]

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=worker, args=(r, args, init_file, results)) for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        outcomes = {}
        try:
            for _ in procs:
                rank, ok, text = results.get(timeout=args.timeout)
                outcomes[rank] = (ok, text)
        except Exception:
            print(f"moe_layer: not every process reported within {args.timeout} s", file=sys.stderr)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failed = False
    for rank in range(args.ranks):
        ok, text = outcomes.get(rank, (False, "no report"))
        print(text)
        failed |= not ok
    print(f"moe_layer: {args.ranks} processes, {args.tokens} tokens each, hidden {args.hidden}, {args.experts} experts, "
          f"top-{args.topk}: {'FAILED' if failed else 'verified'} ({', '.join(args.generations)}; normal and low-latency)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
