"""The data-path scenarios with an mpi4py communicator as the group (moe-ep's MPI transport).

Run by CTest under mpirun (tests/CMakeLists.txt): every rank runs each scenario of scenarios/
(every output checked against reference.py, or torch for Engram and PP) and exits non-zero on any
mismatch or error.
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpi4py import MPI  # noqa: E402  (initializes MPI with MPI_THREAD_MULTIPLE)

import moe_ep  # noqa: E402
from moe_ep import deep_ep  # noqa: E402
import scenarios  # noqa: E402
from scenarios import engram_pp  # noqa: E402


def main():
    comm = MPI.COMM_WORLD
    failed = []
    for name, run in (("v2_compact", lambda: scenarios.v2_compact(comm, deep_ep, seed=31)),
                      ("v2_expanded", lambda: scenarios.v2_expanded(comm, deep_ep, seed=32)),
                      ("v1_normal", lambda: scenarios.v1_normal(comm, deep_ep, seed=33)),
                      ("v1_low_latency", lambda: scenarios.v1_low_latency(comm, deep_ep, seed=34)),
                      ("engram", lambda: engram_pp.engram(comm, deep_ep, seed=35, fp8=True)),
                      ("pp_ring", lambda: engram_pp.pp_ring(comm, deep_ep, seed=36))):
        try:
            run()
        except Exception:
            failed.append(name)
            print(f"[rank {comm.rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    g = moe_ep.resolve_group(comm)
    print(f"[rank {comm.rank}] mpi4py group {g.num_scaleout}x{g.num_scaleup}: "
          f"{'FAILED ' + ', '.join(failed) if failed else 'all scenarios verified'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
