"""Times a small blocking all-reduce from Python against the same calls issued by a C++ loop
in the same processes, round for round, on one communicator.

    PYTHONPATH=build/python mpirun -np 2 -x PYTHONPATH \\
        /usr/bin/python3 examples/python/numpy_allreduce_latency.py [BYTES] [IMPLEMENTATION]

Prints, as bench/collectives_perf does, the slowest rank's time per call: the median of 9
rounds, Python's and C++'s rounds alternating so that both see the same machine.
"""
import statistics
import sys
import time

import numpy as np

import collectives

nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 8
implementation = sys.argv[2] if len(sys.argv) > 2 else "auto"
iters = 2000 if nbytes <= 65536 else 50


def slowest(seconds):
    t = np.array([seconds])
    comm.all_reduce(t, "max")
    return float(t[0])


with collectives.Communication(implementation=implementation) as comm:
    buf = np.ones(max(1, nbytes // 4), np.float32)
    for _ in range(200 if nbytes <= 65536 else 5):
        comm.all_reduce(buf)
    python_rounds, cpp_rounds = [], []
    for _ in range(9):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(buf)
        python_rounds.append(slowest((time.perf_counter() - start) / iters))
        comm.barrier()
        cpp_rounds.append(slowest(comm._time_all_reduce(buf, iters)))
    if comm.rank == 0:
        py_us = statistics.median(python_rounds) * 1e6
        cpp_us = statistics.median(cpp_rounds) * 1e6
        print(f"all_reduce {buf.nbytes} B, {comm.size} ranks, {comm.implementation} "
              f"({comm.all_reduce_algorithm(buf.nbytes)}): Python {py_us:.2f} us, "
              f"C++ loop {cpp_us:.2f} us per call")
