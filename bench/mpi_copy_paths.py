"""How this host's MPI moves one large message: contiguous against strided (a vector datatype).

Run: mpirun -np 2 .venv/bin/python bench/mpi_copy_paths.py   (mpi4py and numpy: the project's environment)

Rank 0 sends 4096 rows of 7168 bytes to rank 1, once from a contiguous buffer and once through a
vector datatype that picks every other row of a buffer twice as large, alternating, after a
warm-up of each. The receive is contiguous in both. Prints the median time of each and its GB/s
(message bytes / time). Where the shared-memory transport has a single-copy mechanism (Open MPI's
vader with CMA), the contiguous message takes one copy and the strided one goes through the
transport's fragments (a copy in and a copy out), about twice the time; docs/performance.md
uses this in its traffic count.
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

ROW, ROWS, REPEATS = 7168, 4096, 25

comm = MPI.COMM_WORLD
if comm.Get_size() != 2:
    raise SystemExit("mpi_copy_paths.py: run with mpirun -np 2")
rank = comm.Get_rank()
source = np.ones(ROW * ROWS * 2, dtype=np.uint8)
target = np.zeros(ROW * ROWS, dtype=np.uint8)
strided = MPI.BYTE.Create_vector(ROWS, ROW, 2 * ROW).Commit()


def transfer(kind):
    comm.Barrier()
    start = time.perf_counter()
    if rank == 0:
        comm.Send([source[: ROW * ROWS], MPI.BYTE] if kind == "contiguous" else [source, 1, strided], 1)
    else:
        comm.Recv([target, MPI.BYTE], 0)
    comm.Barrier()
    return time.perf_counter() - start


times = {"contiguous": [], "strided": []}
for kind in times:
    transfer(kind)  # warm-up: first touch of the pages, connection set-up
for _ in range(REPEATS):
    for kind in times:
        times[kind].append(transfer(kind))
if rank == 1:
    for kind, samples in times.items():
        t = statistics.median(samples)
        print(f"{kind:>10}: {t * 1e3:7.2f} ms for {ROW * ROWS / 1e6:.1f} MB, {ROW * ROWS / t / 1e9:6.2f} GB/s")
strided.Free()
