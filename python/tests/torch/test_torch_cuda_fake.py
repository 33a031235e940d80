"""The backend's CUDA path with a torch built without CUDA (Debian's), against the CUDA runtime and
NCCL on the dynamic linker's path: on a machine without a GPU the CPU stand-in
tests/nccl/fake/fake_cuda_nccl.cc (ctest puts it there; label fake_nccl), which models CUDA's and
NCCL's contracts and proves nothing about a real GPU. Tensors are cuda:N tensors over the
runtime's device memory (_torch_cuda_fake.py); results are downloaded and checked against numpy.

NCCL: the ranks are threads of this process over one HashStore, one device each, as the
stand-in's NCCL models them; CUDA tensors go to the group's own NCCL communicator, with no copy
between host and device. Staged: real processes whose libnccl has no NCCL function, so that CUDA
tensors go to the group's RING or AUTO communicator, which stages them through pinned memory."""
import datetime
import os
import sys
import threading
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

import _torch_cuda_fake as tcf
from _torch_cuda_fake import Buffer, fc, inputs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _launch  # noqa: E402  (python/tests)

import collectives.torch as ct  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_torch_cuda_worker.py")

needs_cuda = pytest.mark.skipif(fc.runtime() is None and
                                os.environ.get("COLLECTIVES_REQUIRE_GPU") != "1",
                                reason="no libcudart.so.13 on the dynamic linker's path")


def run_threads(world, fn, timeout=60, implementation="ring"):
    """fn(pg, rank, world, barrier) on `world` threads, each with its own process group over one
    HashStore (`implementation` for CPU tensors); returns what each returned, or fails naming the
    rank."""
    store = dist.HashStore()
    barrier = threading.Barrier(world, timeout=timeout)
    results, errors = [None] * world, [None] * world

    def body(rank):
        try:
            options = ct.Options(implementation=implementation)
            pg = ct.new_process_group(store, rank, world, datetime.timedelta(seconds=30), options)
            results[rank] = fn(pg, rank, world, barrier)
            del pg
        except BaseException:  # noqa: BLE001  (reported below)
            errors[rank] = traceback.format_exc()
            barrier.abort()

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    assert not hung, f"ranks {hung} of {world} did not finish within {timeout} s"
    for rank, error in enumerate(errors):
        assert error is None, f"rank {rank} raised:\n{error}"
    return results


def _op(name):
    return getattr(dist.ReduceOp, name.upper())


def _opts(kind, **fields):
    opts = getattr(dist, kind)()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


REFERENCE = {"sum": lambda xs: np.sum(xs, axis=0), "max": lambda xs: np.max(xs, axis=0),
             "avg": lambda xs: np.sum(xs, axis=0) / len(xs)}


def nccl_rank(pg, rank, world, barrier):
    """Every collective the backend sends to NCCL without torch's kernels, on cuda:rank; returns
    the failures, the copy counters around the collectives (rank 0) and what was checked."""
    failures, checked = [], []

    def expect(label, got, want):
        checked.append(label)
        if label.endswith("avg") and np.issubdtype(got.dtype, np.floating):
            ok = np.allclose(got, want, rtol=1e-6, atol=0)
        else:
            ok = np.array_equal(got, want)
        if not ok:
            bad = np.flatnonzero(~np.isclose(got, want))[:4]
            failures.append(f"rank {rank} {label}: at {bad.tolist()} got {got[bad].tolist()} "
                            f"want {np.asarray(want)[bad].tolist()}")

    cases = []  # (label, buffers, call, check) made first, so that no copy overlaps the calls
    case = 0
    for dtype in ("float32", "float64", "int32", "int64"):
        for count in (1, 13, 1000):
            case += 1
            every = [inputs(r, count, dtype, case) for r in range(world)]
            ops = ("sum", "max", "avg") if dtype.startswith("float") else ("sum", "max")
            for op in ops:
                a = Buffer(count, dtype, rank).upload(every[rank])
                cases.append((f"{dtype} x{count} all_reduce {op}", a,
                              lambda a=a, op=op: pg.allreduce(
                                  [a.tensor()], _opts("AllreduceOptions", reduceOp=_op(op))),
                              REFERENCE[op](every).astype(dtype)))
            root = world - 1
            b = Buffer(count, dtype, rank).upload(every[rank])
            cases.append((f"{dtype} x{count} broadcast from {root}", b,
                          lambda b=b, root=root: pg.broadcast(
                              [b.tensor()], _opts("BroadcastOptions", rootRank=root)),
                          every[root]))
            gathered = np.concatenate(every)
            x = Buffer(count, dtype, rank).upload(every[rank])
            g = Buffer(count * world, dtype, rank).upload(np.zeros(count * world))
            cases.append((f"{dtype} x{count} all_gather_into_tensor", g,
                          lambda x=x, g=g: pg._allgather_base(g.tensor(), x.tensor()), gathered))
            x2 = Buffer(count, dtype, rank).upload(every[rank])
            g2 = Buffer(count * world, dtype, rank).upload(np.zeros(count * world))
            cases.append((f"{dtype} x{count} all_gather list", g2,
                          lambda x=x2, g=g2: pg.allgather([g.parts(world)], [x.tensor()]),
                          gathered))
            big = [inputs(r, count * world, dtype, case) for r in range(world)]
            want = np.sum(big, axis=0).astype(dtype)[rank * count:(rank + 1) * count]
            s = Buffer(count * world, dtype, rank).upload(big[rank])
            r = Buffer(count, dtype, rank).upload(np.zeros(count))
            cases.append((f"{dtype} x{count} reduce_scatter_tensor sum", r,
                          lambda s=s, r=r: pg._reduce_scatter_base(
                              r.tensor(), s.tensor(), _opts("ReduceScatterOptions")), want))
            s2 = Buffer(count * world, dtype, rank).upload(big[rank])
            r2 = Buffer(count, dtype, rank).upload(np.zeros(count))
            cases.append((f"{dtype} x{count} reduce_scatter list sum", r2,
                          lambda s=s2, r=r2: pg.reduce_scatter(
                              [r.tensor()], [s.parts(world)], _opts("ReduceScatterOptions")),
                          want))

    barrier.wait()
    if rank == 0:
        tcf.reset_copy_stats()
    barrier.wait()
    works = [call() for _, _, call, _ in cases]
    for work in works:
        work.wait()
    barrier.wait()
    stats = tcf.copy_stats() if rank == 0 else None
    barrier.wait()
    for (label, out, _, want), work in zip(cases, works):
        assert work.is_completed() and work.is_success(), label
        expect(label, out.download(), want)
    # The packer takes CPU tensors only: a coalesced all-reduce of CUDA tensors is refused by
    # every rank before anything is issued, and the group goes on.
    a = Buffer(4, "float32", rank).upload(np.arange(4))
    try:
        pg.allreduce_coalesced([a.tensor()], _opts("AllreduceCoalescedOptions")).wait()
        refused = "did not raise"
    except Exception as error:  # noqa: BLE001  (checked by the test)
        refused = str(error)
    expect("after the refusal", a.download(), np.arange(4, dtype=np.float32))
    c = Buffer(4, "float32", rank).upload(np.full(4, rank + 1))
    pg.allreduce([c.tensor()], _opts("AllreduceOptions")).wait()
    expect("all_reduce after the refusal", c.download(),
           np.full(4, world * (world + 1) / 2, np.float32))
    others = {}
    count = 7
    every = [inputs(r, count, "float32", 99) for r in range(world)]
    spread = [inputs(r, count * world, "float32", 98) for r in range(world)]

    def other(name, call, out, want):
        try:
            call()
            got = out.download()
            others[name] = True if np.array_equal(got, want) else f"got {got.tolist()}"
        except Exception as error:  # noqa: BLE001  (checked by the test)
            others[name] = f"{type(error).__name__}: {error}"

    a = Buffer(count, "float32", rank).upload(every[rank])
    other("reduce", lambda: pg.reduce([a.tensor()], _opts("ReduceOptions", rootRank=0)).wait(),
          a, np.sum(every, axis=0).astype(np.float32) if rank == 0 else every[rank])
    s = Buffer(count * world, "float32", rank).upload(spread[rank])
    o = Buffer(count * world, "float32", rank).upload(np.zeros(count * world))
    other("all_to_all_single",
          lambda: pg.alltoall_base(o.tensor(), s.tensor(), [], [], _opts("AllToAllOptions")).wait(),
          o, np.concatenate([spread[r][rank * count:(rank + 1) * count] for r in range(world)]))
    x = Buffer(count, "float32", rank).upload(every[rank])
    g = Buffer(count * world, "float32", rank).upload(np.zeros(count * world))
    root = world - 1
    other("gather", lambda: pg.gather([g.parts(world)] if rank == root else [], [x.tensor()],
                                      _opts("GatherOptions", rootRank=root)).wait(),
          g, np.concatenate(every) if rank == root else np.zeros(count * world, np.float32))
    s = Buffer(count * world, "float32", rank).upload(spread[rank])
    r = Buffer(count, "float32", rank).upload(np.zeros(count))
    other("scatter", lambda: pg.scatter([r.tensor()], [s.parts(world)] if rank == root else [],
                                        _opts("ScatterOptions", rootRank=root)).wait(),
          r, spread[root][rank * count:(rank + 1) * count])
    if world > 1 and rank < 2:
        m = Buffer(count, "float32", rank).upload(every[rank])
        other("send/recv", lambda: (pg.send if rank == 0 else pg.recv)([m.tensor()], 1 - rank,
                                                                       0).wait(),
              m, every[0])
    return {"failures": failures, "stats": stats, "checked": len(checked), "cases": len(cases),
            "refused": refused, "others": others}


@needs_cuda
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_nccl_takes_cuda_tensors(world):
    if fc.device_count() < world:
        pytest.skip(f"{world} ranks need {world} devices; {fc.device_count()} visible")
    results = run_threads(world, nccl_rank)
    for rank, result in enumerate(results):
        assert result["failures"] == [], result["failures"]
        # 4 dtypes x 3 counts x (5 + 3 or 2 all-reduce ops), and the 2 checks after the refusal.
        assert result["cases"] == 90 and result["checked"] == 92, result
        assert "packer takes CPU tensors" in result["refused"], result
        assert all(ok is True for ok in result["others"].values()), result["others"]
    stats = results[0]["stats"]
    if stats is not None:
        # NCCL reads and writes the tensors where they are: nothing crossed to the host.
        assert stats[0] == 0 and stats[2] == 0, stats


STAGING = {"COLLECTIVES_CUDA_STAGING_BYTES": "4096"}


@needs_cuda
@pytest.mark.parametrize("world,implementation", [(2, "ring"), (3, "auto")])
def test_staged_cuda_tensors_in_processes(world, implementation):
    no_nccl = os.environ.get("COLLECTIVES_FAKE_CUDART_DIR")
    if not no_nccl:
        pytest.skip("COLLECTIVES_FAKE_CUDART_DIR (the stand-in's libcudart beside a libnccl "
                    "without NCCL) is not set")
    env = dict(STAGING, LD_LIBRARY_PATH=no_nccl, COLLECTIVES_IMPLEMENTATION=implementation)
    results = _launch.run(world, "staged", env=env, timeout=60, worker=WORKER)
    text = "\n".join(f"rank {r}: exit {rc}, result {res}\n{err[-3000:]}"
                     for r, (rc, res, _, err) in enumerate(results))
    for rc, result, _, _ in results:
        assert rc == 0 and result is not None, text
        assert result["failures"] == [], text
        assert result["checked"] == result["expected"], text
        assert result["nccl"] is False, text
        # Staged: the tensors crossed to pinned host memory and back.
        assert result["copies"] > 0, text
        assert all(ok is True for ok in result["others"].values()), text
        assert result["cpu"] is True, text


def nccl_group_rank(pg, rank, world, barrier):
    a = Buffer(5, "float32", rank).upload(np.full(5, rank + 1))
    pg.allreduce([a.tensor()], _opts("AllreduceOptions")).wait()
    try:
        pg.allreduce([torch.ones(3)], _opts("AllreduceOptions")).wait()
        refused = "did not raise"
    except Exception as error:  # noqa: BLE001  (checked by the test)
        refused = f"{type(error).__name__}: {error}"
    return pg.implementation, a.download().tolist(), refused


@needs_cuda
def test_nccl_group_takes_cuda_tensors_only():
    # implementation="nccl": the group's own communicator is NCCL's, and takes every call.
    if fc.device_count() < 2:
        pytest.skip(f"2 ranks need 2 devices; {fc.device_count()} visible")
    results = run_threads(2, nccl_group_rank, implementation="nccl")
    for rank, (implementation, got, refused) in enumerate(results):
        assert implementation == "nccl" and got == [3.0] * 5, (rank, got)
        assert "InvalidArgumentError" in refused and "on cpu" in refused, (rank, refused)
