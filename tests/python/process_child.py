"""The body of each process that conftest.run_processes starts (a module of its own that imports
nothing at the top, so the process's environment is set before the test's function, its module
and moe_ep are imported: they arrive pickled and are unpickled here, after os.environ.update)."""

import os
import pickle
import traceback


def child(rank, world, init_file, call, env, results, clean_exit):
    """Sets env, joins the gloo group, runs the pickled (fn, args) and reports on results."""
    os.environ.update(env)
    try:
        import datetime

        import torch.distributed as dist
        fn, args = pickle.loads(call)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world, dist.group.WORLD, *args)
        results.put((rank, "ok", result))
    except BaseException as e:  # report everything, assertion failures included
        results.put((rank, "error", {
            "type": type(e).__name__, "module": type(e).__module__,
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__],
            "message": str(e), "ranks": list(getattr(e, "ranks", []) or []),
            "traceback": traceback.format_exc()}))
    try:
        results.close()
        results.join_thread()
    except Exception:
        pass
    if not clean_exit:
        # Leave without finalization: a peer that died must not make this process hang in exit.
        os._exit(0)
