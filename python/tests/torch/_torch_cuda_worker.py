"""One rank of a torch CUDA test job (started by test_torch_cuda_fake.py through _launch):
`_torch_cuda_worker.py SCENARIO`. The group is made with init_process_group("collectives") from
the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, COLLECTIVES_IMPLEMENTATION); the
tensors are cuda:(rank % devices) tensors over the runtime's device memory (_torch_cuda_fake.py),
checked against numpy. The last line of stdout is `RESULT {json}`."""
import ctypes
import datetime
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _torch_cuda_fake as tcf  # noqa: E402
from _torch_cuda_fake import Buffer, fc, inputs  # noqa: E402

import collectives.torch  # noqa: E402,F401  (registers the backend)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def nccl_loads():
    """Whether the libnccl.so.2 on the dynamic linker's path has NCCL's functions."""
    try:
        ctypes.CDLL("libnccl.so.2").ncclGetVersion
        return True
    except (OSError, AttributeError):
        return False


def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def staged():
    """The collectives on CUDA tensors where NCCL is not usable: the group's RING or AUTO
    communicator stages them. Every form whose tensors need no torch kernel."""
    dist.init_process_group("collectives", init_method="env://",
                            timeout=datetime.timedelta(seconds=30))
    device = RANK % max(1, fc.device_count())
    failures, checked = [], []

    def expect(label, got, want):
        checked.append(label)
        ok = (np.allclose(got, want, rtol=1e-6, atol=0) if label.endswith("avg")
              else np.array_equal(got, want))
        if not ok:
            bad = np.flatnonzero(~np.isclose(got, want))[:4]
            failures.append(f"{label}: at {bad.tolist()} got {got[bad].tolist()} "
                            f"want {np.asarray(want)[bad].tolist()}")

    # What one all-reduce copies between host and device (the uploads and downloads around it
    # are copies too).
    probe = Buffer(1000, "float32", device).upload(np.ones(1000))
    tcf.reset_copy_stats()
    dist.all_reduce(probe.tensor())
    copies = (tcf.copy_stats() or [0, 0, 0])[2]
    expect("probe", probe.download(), np.full(1000, WORLD, np.float32))
    expected = 1
    case = 0
    for dtype in ("float32", "int64"):
        for count in (1, 13, 5000):
            case += 1
            every = [inputs(r, count, dtype, case) for r in range(WORLD)]
            label = f"{dtype} x{count}"
            ops = ("sum", "max", "avg") if dtype.startswith("float") else ("sum", "max")
            for op in ops:
                a = Buffer(count, dtype, device).upload(every[RANK])
                dist.all_reduce(a.tensor(), op=getattr(dist.ReduceOp, op.upper()))
                want = {"sum": np.sum, "max": np.max, "avg": np.mean}[op](every, axis=0)
                expect(f"{label} all_reduce {op}", a.download(), want.astype(dtype))
            root = WORLD - 1
            b = Buffer(count, dtype, device).upload(every[RANK])
            dist.broadcast(b.tensor(), src=root)
            expect(f"{label} broadcast", b.download(), every[root])

            gathered = np.concatenate(every)
            x = Buffer(count, dtype, device).upload(every[RANK])
            g = Buffer(count * WORLD, dtype, device).upload(np.zeros(count * WORLD))
            dist.all_gather_into_tensor(g.tensor(), x.tensor())
            expect(f"{label} all_gather_into_tensor", g.download(), gathered)
            g = Buffer(count * WORLD, dtype, device).upload(np.zeros(count * WORLD))
            work = dist.all_gather(g.parts(WORLD), x.tensor(), async_op=True)
            work.wait()
            expect(f"{label} all_gather list", g.download(), gathered)

            big = [inputs(r, count * WORLD, dtype, case) for r in range(WORLD)]
            mine = slice(RANK * count, (RANK + 1) * count)
            s = Buffer(count * WORLD, dtype, device).upload(big[RANK])
            r = Buffer(count, dtype, device).upload(np.zeros(count))
            dist.reduce_scatter_tensor(r.tensor(), s.tensor())
            expect(f"{label} reduce_scatter_tensor", r.download(),
                   np.sum(big, axis=0).astype(dtype)[mine])
            r = Buffer(count, dtype, device).upload(np.zeros(count))
            dist.reduce_scatter(r.tensor(), s.parts(WORLD))
            expect(f"{label} reduce_scatter list", r.download(),
                   np.sum(big, axis=0).astype(dtype)[mine])
            expected += len(ops) + 5

    main_checked = len(checked)
    # The other collectives, once each (a wrong result is a failure above).
    others = {}

    def other(name, call):
        try:
            call()
            others[name] = True
        except Exception as error:  # noqa: BLE001  (reported)
            others[name] = f"{type(error).__name__}: {error}"

    count = 7
    every = [inputs(r, count, "float32", 99) for r in range(WORLD)]

    def reduce():
        a = Buffer(count, "float32", device).upload(every[RANK])
        dist.reduce(a.tensor(), dst=0)
        if RANK == 0:
            expect("reduce", a.download(), np.sum(every, axis=0).astype(np.float32))

    def all_to_all_single():
        src = [inputs(r, count * WORLD, "float32", 98) for r in range(WORLD)]
        s = Buffer(count * WORLD, "float32", device).upload(src[RANK])
        o = Buffer(count * WORLD, "float32", device).upload(np.zeros(count * WORLD))
        dist.all_to_all_single(o.tensor(), s.tensor())
        want = np.concatenate([src[r][RANK * count:(RANK + 1) * count] for r in range(WORLD)])
        expect("all_to_all_single", o.download(), want)

    def send_recv():
        a = Buffer(count, "float32", device).upload(every[RANK])
        b = Buffer(count, "float32", device).upload(np.zeros(count))
        right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        works = [dist.isend(a.tensor(), right), dist.irecv(b.tensor(), left)]
        for work in works:
            work.wait()
        expect("send/recv", b.download(), every[left])

    def gather():
        x = Buffer(count, "float32", device).upload(every[RANK])
        g = Buffer(count * WORLD, "float32", device).upload(np.zeros(count * WORLD))
        root = WORLD - 1
        dist.gather(x.tensor(), g.parts(WORLD) if RANK == root else None, dst=root)
        if RANK == root:
            expect("gather", g.download(), np.concatenate(every))

    def scatter():
        src = [inputs(r, count * WORLD, "float32", 97) for r in range(WORLD)]
        s = Buffer(count * WORLD, "float32", device).upload(src[RANK])
        r = Buffer(count, "float32", device).upload(np.zeros(count))
        root = WORLD - 1
        dist.scatter(r.tensor(), s.parts(WORLD) if RANK == root else None, src=root)
        expect("scatter", r.download(), src[root][RANK * count:(RANK + 1) * count])

    other("reduce", reduce)
    other("gather", gather)
    other("scatter", scatter)
    other("all_to_all_single", all_to_all_single)
    if WORLD > 1:
        other("send_recv", send_recv)
    # CPU tensors on the same group after the CUDA calls.
    t = torch.full((5,), float(RANK + 1))
    dist.all_reduce(t)
    cpu_ok = t.tolist() == [WORLD * (WORLD + 1) / 2] * 5
    dist.destroy_process_group()
    report(failures=failures, checked=main_checked, expected=expected,
           nccl=nccl_loads(), copies=copies, others=others, cpu=cpu_ok)


if __name__ == "__main__":
    {"staged": staged}[sys.argv[1]](*sys.argv[2:])
