"""All-reduces a numpy array across the processes of a job.

Launch with Open MPI (the ranks find each other through mpirun's PMIx server; nothing to
export):

    PYTHONPATH=build/python mpirun -np 2 -x PYTHONPATH /usr/bin/python3 examples/python/numpy_allreduce.py

or with torchrun, srun or TF_CONFIG, or alone (one rank).
"""
import numpy as np

import collectives

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
