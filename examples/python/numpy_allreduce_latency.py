"""Times a small all-reduce through the Python module, for comparison with the C++ sweep
(bench/collectives_perf -b 8 -e 8 with the same implementation and world size).

    PYTHONPATH=build/python mpirun -np 2 -x PYTHONPATH -x MASTER_PORT=29500 \\
        /usr/bin/python3 examples/python/numpy_allreduce_latency.py [BYTES] [IMPLEMENTATION]

Prints, as collectives_perf does, the slowest rank's time per call: the median of 5 rounds of
timed calls after a warm-up.
"""
import statistics
import sys
import time

import numpy as np

import collectives

nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 8
implementation = sys.argv[2] if len(sys.argv) > 2 else "auto"
iters = 2000 if nbytes <= 65536 else 50

with collectives.Communication(implementation=implementation) as comm:
    buf = np.ones(max(1, nbytes // 4), np.float32)
    for _ in range(200 if nbytes <= 65536 else 5):
        comm.all_reduce(buf)
    rounds = []
    for _ in range(5):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(buf)
        elapsed = np.array([(time.perf_counter() - start) / iters])
        comm.all_reduce(elapsed, "max")  # the slowest rank's
        rounds.append(float(elapsed[0]))
    if comm.rank == 0:
        print(f"all_reduce {buf.nbytes} B, {comm.size} ranks, {comm.implementation} "
              f"({comm.all_reduce_algorithm(buf.nbytes)}): "
              f"{statistics.median(rounds) * 1e6:.2f} us per call")
