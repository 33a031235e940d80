"""One rank of a CUDA test job (started by test_cuda_fake.py): `_cuda_worker.py SCENARIO [ARGS]`.

Inputs live in CUDA memory from _fake_cuda (device memory of cuda:(rank % devices), or pinned
host memory), handed to the module as DLPack producers and as __cuda_array_interface__ objects;
results are copied back with cudaMemcpy and checked against numpy. The last line of stdout is
`RESULT {json}`."""
import json
import os
import sys
import threading
import time

import numpy as np

import collectives
import _fake_cuda as fc

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def inputs(rank, count, dtype, case):
    """Rank `rank`'s input of case `case`: small integers, exact in every dtype."""
    return ((np.arange(count) * 7 + rank * 13 + case) % 23 - 11).astype(dtype)


REFERENCE = {"sum": lambda xs: np.sum(xs, axis=0), "max": lambda xs: np.max(xs, axis=0),
             "min": lambda xs: np.min(xs, axis=0)}


def staged(implementation):
    """Every collective that RING and AUTO stage, on cuda:(rank % 4), through DLPack and the
    CUDA array interface, blocking and async, against numpy."""
    device = RANK % max(1, fc.device_count())
    comm = collectives.Communication(implementation=implementation, timeout=30)
    failures, cases, streams = [], 0, []

    def view(array, kind):
        return array if kind == "dlpack" else array.cai(stream=1)

    def expect(label, got, want):
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)[:4]
            failures.append(f"{label}: at {bad.tolist()} got {got[bad].tolist()} "
                            f"want {np.asarray(want)[bad].tolist()}")

    for dtype in ("float32", "float64", "int32", "int64", "float16"):
        for count in (1, 7, 1000, 12345):
            for kind in ("dlpack", "cai"):
                cases += 1
                case = cases
                label = f"{dtype} x{count} {kind}"
                every = [inputs(r, count, dtype, case) for r in range(WORLD)]
                for op in ("sum", "max"):
                    a = fc.DeviceArray(count, dtype, device)
                    a.upload(every[RANK])
                    comm.all_reduce(view(a, kind), op)
                    expect(f"all_reduce {op} in place {label}", a.download(),
                           REFERENCE[op](np.stack(every)))
                    streams += a.streams
                out = fc.DeviceArray(count, dtype, device)
                a = fc.DeviceArray(count, dtype, device)
                a.upload(every[RANK])
                work = comm.all_reduce(view(a, kind), "min", out=view(out, kind), async_op=True)
                work.wait()
                expect(f"all_reduce min async out {label}", out.download(),
                       REFERENCE["min"](np.stack(every)))
                expect(f"all_reduce input kept {label}", a.download(), every[RANK])
                root = case % WORLD
                b = fc.DeviceArray(count, dtype, device)
                b.upload(every[RANK])
                comm.broadcast(view(b, kind), root=root)
                expect(f"broadcast root {root} {label}", b.download(), every[root])
                gathered = fc.DeviceArray(count * WORLD, dtype, device)
                comm.all_gather(view(a, kind), view(gathered, kind))
                expect(f"all_gather {label}", gathered.download(), np.concatenate(every))
                big = [inputs(r, count * WORLD, dtype, case + 1) for r in range(WORLD)]
                s = fc.DeviceArray(count * WORLD, dtype, device)
                s.upload(big[RANK])
                r = fc.DeviceArray(count, dtype, device)
                comm.reduce_scatter(view(s, kind), view(r, kind), "sum")
                expect(f"reduce_scatter {label}", r.download(),
                       np.sum(np.stack(big), axis=0)[RANK * count:(RANK + 1) * count])

    # Pinned host memory (kDLCUDAHost) is host memory: the ring reads it in place.
    count = 5000
    every = [inputs(r, count, "float32", 99) for r in range(WORLD)]
    p = fc.DeviceArray(count, "float32", device, pinned_memory=True)
    p.upload(every[RANK])
    comm.all_reduce(p)
    expect("all_reduce pinned", p.download(), np.sum(np.stack(every), axis=0))
    cases += 1

    # An interface's own stream: its pending work (a large copy, then the input's) must be done
    # before the collective reads the input.
    count = 1 << 16
    every = [inputs(r, count, "float32", 7) for r in range(WORLD)]
    s = fc.stream()
    pad = fc.DeviceArray(32 << 20, "uint8", device)
    host_pad = fc.pinned(32 << 20)
    host_in = fc.pinned(count * 4).view(np.float32)
    host_in[:] = every[RANK]
    c = fc.DeviceArray(count, "float32", device)
    rt = fc.runtime()
    assert rt.cudaMemcpyAsync(pad.ptr, host_pad.ctypes.data, 32 << 20, 1, s) == 0
    assert rt.cudaMemcpyAsync(c.ptr, host_in.ctypes.data, count * 4, 1, s) == 0
    comm.all_reduce(c.cai(stream=s))
    expect("all_reduce on a producer stream", c.download(), np.sum(np.stack(every), axis=0))
    cases += 1

    report(cases=cases, failures=failures[:10], streams=sorted(set(map(str, streams))))


def unavailable():
    """No usable CUDA runtime: CUDA buffers are refused with NotSupportedError naming the device
    before anything is issued; the communicator goes on with host buffers."""
    if fc.usable_runtime():
        report(skip="a CUDA runtime with a device is usable here")
        return
    comm = collectives.Communication(implementation="ring", timeout=20)
    errors = []
    t = fc.FakeCudaTensor(device=1)
    try:
        comm.all_reduce(t)
        errors.append("no error")
    except collectives.NotSupportedError as e:
        errors.append(str(e))
    # A CUDA array over host memory: the interface says CUDA, which is not usable here.
    host = np.full(8, 5.0, np.float32)
    cai = type("Cai", (), {})()
    cai.__cuda_array_interface__ = {"shape": (8,), "typestr": "<f4",
                                    "data": (host.ctypes.data, False), "version": 3,
                                    "strides": None, "stream": None}
    try:
        comm.broadcast(cai, root=1 % WORLD)
        errors.append("no error")
    except collectives.NotSupportedError as e:
        errors.append(str(e))
    ok = np.full(4, RANK + 1.0, np.float32)
    comm.all_reduce(ok)
    report(errors=errors, asked=t.asked, untouched=bool((host == 5.0).all()),
           after=ok.tolist())


def nccl(world):
    """An NCCL communicator per rank, the ranks as threads of this process (the stand-in's NCCL
    meets within one process): all-reduce, broadcast, all-gather and reduce-scatter of device
    buffers of cuda:rank through DLPack and the CUDA array interface."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    failures, results = [], {}

    def rank_main(rank):
        try:
            fc.set_device(rank)
            spec = collectives.ClusterSpec(rank=rank, world_size=world, master_port=port,
                                           job_id=f"nccl-{port}")
            comm = collectives.Communication(spec, implementation="nccl", timeout=20)
            count = 1000
            every = [inputs(r, count, "float32", 3) for r in range(world)]
            a = fc.DeviceArray(count, "float32", rank)
            a.upload(every[rank])
            comm.all_reduce(a)
            got = {"all_reduce": a.download().tolist() == np.sum(np.stack(every), 0).tolist()}
            b = fc.DeviceArray(count, "float32", rank)
            b.upload(every[rank])
            comm.broadcast(b.cai(stream=1), root=world - 1)
            got["broadcast"] = b.download().tolist() == every[world - 1].tolist()
            g = fc.DeviceArray(count * world, "float32", rank)
            a.upload(every[rank])
            comm.all_gather(a, g, async_op=True).wait()
            got["all_gather"] = g.download().tolist() == np.concatenate(every).tolist()
            r = fc.DeviceArray(count // world, "float32", rank)
            part = count // world
            s = fc.DeviceArray(part * world, "float32", rank)
            s.upload(every[rank][:part * world])
            comm.reduce_scatter(s, r)
            total = np.sum(np.stack([e[:part * world] for e in every]), 0)
            want = total[rank * part:(rank + 1) * part]
            got["reduce_scatter"] = r.download().tolist() == want.tolist()
            got["streams"] = a.streams
            try:
                comm.all_reduce(np.zeros(4, np.float32))
                got["host buffer"] = "accepted"
            except collectives.Error as e:
                got["host buffer"] = type(e).__name__
            results[rank] = got
            comm.close()
        except Exception as e:  # reported, not raised in the thread
            failures.append(f"rank {rank}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    report(failures=failures, results={str(k): v for k, v in results.items()},
           alive=[t.is_alive() for t in threads])


if __name__ == "__main__":
    scenario = sys.argv[1]
    if scenario == "staged":
        staged(sys.argv[2])
    elif scenario == "unavailable":
        unavailable()
    elif scenario == "nccl":
        nccl(int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)
