"""All-reduces a numpy array across the processes of a job.

Launch with Open MPI (MASTER_PORT names the port rank 0's rendezvous store listens on; mpirun
sets the ranks, OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE, but no port):

    PYTHONPATH=build/python mpirun -np 2 -x PYTHONPATH -x MASTER_PORT=29500 \\
        /usr/bin/python3 examples/python/numpy_allreduce.py

or with torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or alone (one
rank). Across hosts, also pass -x MASTER_ADDR=<rank 0's host>.
"""
import os
import sys

import numpy as np

import collectives

if "OMPI_COMM_WORLD_SIZE" in os.environ and "MASTER_PORT" not in os.environ:
    sys.exit("numpy_allreduce.py: under mpirun, export MASTER_PORT (mpirun -x MASTER_PORT=29500): "
             "rank 0's rendezvous store listens there")

with collectives.Communication() as comm:  # collectives.ClusterSpec.from_environment()
    grads = np.full(1000, comm.rank + 1, dtype=np.float32)
    comm.all_reduce(grads, "avg")  # in place, on every rank
    expected = (comm.size + 1) / 2
    assert np.allclose(grads, expected), (grads[:4], expected)

    # Async: overlap the reduction with other work, then wait.
    work = comm.all_reduce_async(np.arange(4, dtype=np.int64), "sum")
    total = work.wait()
    assert (total == np.arange(4) * comm.size).all(), total

    # Many small arrays in a few fused buckets.
    layers = [np.ones(n, np.float32) for n in (10, 200, 3000)]
    collectives.packing.all_reduce(comm, layers, "sum")
    assert all((a == comm.size).all() for a in layers)

    print(f"rank {comm.rank} of {comm.size}: avg = {grads[0]} ({comm.implementation})")
