"""One rank of a test job (started by _launch.py): `_worker.py SCENARIO [ARGS]`.

Every rank derives every rank's inputs from (rank, case number), so it checks its own results
against numpy alone. The last line of stdout is `RESULT {json}` with the cases run and the
failures found."""
import gc
import json
import os
import signal
import sys
import time

import numpy as np

import collectives

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


# ---- dtypes: the numpy array that holds each, and how values go in and out of it ----

def _bf16_encode(x):
    # Integer-valued inputs of at most 8 significant bits: truncation is exact.
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _bf16_decode(a):
    return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


class DType:
    def __init__(self, name, storage, override=None, encode=None, decode=None):
        self.name, self.storage, self.override = name, np.dtype(storage), override
        self.encode = encode or (lambda x: np.asarray(x).astype(self.storage))
        self.decode = decode or (lambda a: a.astype(np.float64))
        self.is_int = self.storage.kind in "iu" and override is None
        self.unsigned = self.storage.kind == "u" and override is None

    def kw(self):
        return {"dtype": self.override} if self.override else {}


DTYPES = [
    DType("f32", np.float32), DType("f64", np.float64), DType("f16", np.float16),
    DType("bf16", np.uint16, "bf16", _bf16_encode, _bf16_decode),
    DType("i8", np.int8), DType("u8", np.uint8), DType("i32", np.int32), DType("i64", np.int64),
]
OPS = ["sum", "prod", "min", "max", "avg"]
SIZES = [0, 1, 13, 20011]  # the last crosses small_message_bytes and many chunks


def inputs(rank, case, count, dt, op="sum"):
    """Rank `rank`'s input of case `case`, as float64: small integers whose sums and products
    over 4 ranks are exact in every dtype."""
    rng = np.random.default_rng([rank, case])
    lo, hi = (0, 3) if dt.unsigned else ((-2, 2) if op == "prod" else (-4, 4))
    return rng.integers(lo, hi + 1, size=count).astype(np.float64)


def reduce_ref(values, op, dt, n):
    stack = np.stack(values)
    if op == "sum":
        return stack.sum(0)
    if op == "prod":
        return stack.prod(0)
    if op == "min":
        return stack.min(0)
    if op == "max":
        return stack.max(0)
    s = stack.sum(0)
    if dt.is_int:  # integer division, truncating toward zero
        return np.sign(s) * (np.abs(s) // n)
    return s / n


class Checker:
    def __init__(self):
        self.cases = 0
        self.failures = []

    def expect(self, label, got_array, want, dt, op="sum"):
        got = dt.decode(got_array)
        want = np.asarray(want, np.float64)
        if got.shape != want.shape:
            self.failures.append(f"{label}: shape {got.shape} != {want.shape}")
            return
        rtol = 0.0
        if op == "avg" and not dt.is_int:
            rtol = {"f16": 1e-3, "bf16": 8e-3}.get(dt.name, 1e-6)
        if not np.allclose(got, want, rtol=rtol, atol=0.0):
            bad = np.flatnonzero(~np.isclose(got, want, rtol=rtol, atol=0.0))
            i = int(bad[0])
            self.failures.append(f"{label}: {len(bad)} wrong elements, first [{i}] "
                                 f"got {got[i]} want {want[i]}")

    def run(self, label, fn):
        self.cases += 1
        try:
            fn()
        except collectives.Error as e:
            self.failures.append(f"{label}: {type(e).__name__}: {e}")
            raise
        except Exception as e:  # noqa: BLE001 - every failure is reported to the parent
            self.failures.append(f"{label}: {type(e).__name__}: {e}")


SENTINEL = 7  # written into output buffers first: a rank that should not get them keeps it


def full(count, dt, value=SENTINEL):
    return dt.encode(np.full(count, value, np.float64))


# ---- the matrix ----

def matrix(comm, chk, groups):
    n, r = comm.size, comm.rank
    case = 0

    def next_case():
        nonlocal case
        case += 1
        return case

    for dt in DTYPES:
        for count in SIZES:
            if "core" in groups:
                for op in OPS:
                    for in_place in (True, False):
                        c = next_case()

                        def all_reduce(c=c, op=op, in_place=in_place, count=count, dt=dt):
                            mine = dt.encode(inputs(r, c, count, dt, op))
                            want = reduce_ref([inputs(k, c, count, dt, op) for k in range(n)],
                                              op, dt, n)
                            if in_place:
                                got = comm.all_reduce(mine, op, **dt.kw())
                            else:
                                before = mine.copy()
                                got = comm.all_reduce(mine, op, out=full(count, dt), **dt.kw())
                                assert np.array_equal(mine, before), "send was written"
                            chk.expect(label, got, want, dt, op)

                        label = f"all_reduce {dt.name} n={count} {op} in_place={in_place}"
                        chk.run(label, all_reduce)

                for in_place in (True, False):
                    c = next_case()
                    root = c % n

                    def broadcast(c=c, root=root, in_place=in_place, count=count, dt=dt):
                        mine = dt.encode(inputs(r, c, count, dt))
                        want = inputs(root, c, count, dt)
                        if in_place:
                            got = comm.broadcast(mine, root, **dt.kw())
                        else:
                            got = comm.broadcast(mine, root, out=full(count, dt), **dt.kw())
                        chk.expect(label, got, want, dt)

                    label = f"broadcast {dt.name} n={count} root={root} in_place={in_place}"
                    chk.run(label, broadcast)

                    c = next_case()

                    def all_gather(c=c, in_place=in_place, count=count, dt=dt):
                        want = np.concatenate([inputs(k, c, count, dt) for k in range(n)])
                        if in_place:
                            recv = full(n * count, dt)
                            recv[r * count:(r + 1) * count] = dt.encode(inputs(r, c, count, dt))
                            comm.all_gather(recv[r * count:(r + 1) * count], recv, **dt.kw())
                        else:
                            recv = full(n * count, dt)
                            comm.all_gather(dt.encode(inputs(r, c, count, dt)), recv, **dt.kw())
                        chk.expect(label, recv, want, dt)

                    label = f"all_gather {dt.name} n={count} in_place={in_place}"
                    chk.run(label, all_gather)

                    for op in ("sum", "max"):
                        c = next_case()

                        def reduce_scatter(c=c, op=op, in_place=in_place, count=count, dt=dt):
                            send = dt.encode(inputs(r, c, n * count, dt, op))
                            want = reduce_ref([inputs(k, c, n * count, dt, op) for k in range(n)],
                                              op, dt, n)[r * count:(r + 1) * count]
                            if in_place:
                                recv = send[r * count:(r + 1) * count]
                            else:
                                recv = full(count, dt)
                            comm.reduce_scatter(send, recv, op, **dt.kw())
                            chk.expect(label, recv, want, dt, op)

                        label = f"reduce_scatter {dt.name} n={count} {op} in_place={in_place}"
                        chk.run(label, reduce_scatter)

            if "rooted" in groups:
                rooted_cases(comm, chk, dt, count, next_case)

    if "core" in groups:
        core_extras(comm, chk, next_case)
    if "rooted" in groups:
        c = next_case()
        chk.run("all_to_all uneven", lambda: all_to_all_uneven(comm, chk, c))
        if n > 1:
            for count in (0, 1, 13, 100003):
                c = next_case()
                chk.run(f"send/recv ring n={count}", lambda c=c, count=count:
                        send_recv_ring(comm, chk, c, count))
    chk.run("barrier", comm.barrier)


def rooted_cases(comm, chk, dt, count, next_case):
    n, r = comm.size, comm.rank
    for op in ("sum", "min", "avg"):
        c = next_case()
        root = c % n
        for in_place in (False, True):
            def reduce(c=c, op=op, root=root, in_place=in_place):
                mine = dt.encode(inputs(r, c, count, dt, op))
                want = reduce_ref([inputs(k, c, count, dt, op) for k in range(n)], op, dt, n)
                if r == root:
                    if in_place:
                        got = comm.reduce(mine, None, op, root, **dt.kw())
                    else:
                        got = comm.reduce(mine, full(count, dt), op, root, **dt.kw())
                    chk.expect(label, got, want, dt, op)
                else:
                    before = mine.copy()
                    comm.reduce(mine, None, op, root, **dt.kw())
                    assert np.array_equal(mine, before), "a non-root's send was written"

            label = f"reduce {dt.name} n={count} {op} root={root} in_place={in_place}"
            chk.run(label, reduce)

    c = next_case()
    root = (c + 1) % n

    def gather():
        mine = dt.encode(inputs(r, c, count, dt))
        recv = full(n * count, dt) if r == root else None
        got = comm.gather(mine, recv, root, **dt.kw())
        if r == root:
            chk.expect(label, got, np.concatenate([inputs(k, c, count, dt) for k in range(n)]), dt)

    label = f"gather {dt.name} n={count} root={root}"
    chk.run(label, gather)

    c = next_case()

    def scatter():
        send = dt.encode(inputs(r, c, n * count, dt)) if r == root else None
        recv = full(count, dt)
        comm.scatter(send, recv, root, **dt.kw())
        chk.expect(label, recv, inputs(root, c, n * count, dt)[r * count:(r + 1) * count], dt)

    label = f"scatter {dt.name} n={count} root={root}"
    chk.run(label, scatter)

    c = next_case()

    def all_to_all():
        send = dt.encode(inputs(r, c, n * count, dt))
        recv = full(n * count, dt)
        comm.all_to_all(send, recv, **dt.kw())
        want = np.concatenate([inputs(j, c, n * count, dt)[r * count:(r + 1) * count]
                               for j in range(n)])
        chk.expect(label, recv, want, dt)

    label = f"all_to_all {dt.name} n={count}"
    chk.run(label, all_to_all)


def all_to_all_uneven(comm, chk, c):
    n, r = comm.size, comm.rank
    dt = DTYPES[0]
    counts = [[(i + 2 * j + 1) % 5 for j in range(n)] for i in range(n)]  # i sends counts[i][j] to j
    send_counts = counts[r]
    recv_counts = [counts[j][r] for j in range(n)]
    data = {i: inputs(i, c, sum(counts[i]), dt) for i in range(n)}
    offsets = {i: np.concatenate([[0], np.cumsum(counts[i])]).astype(int) for i in range(n)}
    recv = full(sum(recv_counts), dt)
    comm.all_to_all(dt.encode(data[r]), recv, send_counts, recv_counts)
    want = np.concatenate([data[j][offsets[j][r]:offsets[j][r + 1]] for j in range(n)])
    chk.expect("all_to_all uneven", recv, want, dt)


def send_recv_ring(comm, chk, c, count):
    n, r = comm.size, comm.rank
    dt = DTYPES[1]
    right, left = (r + 1) % n, (r - 1) % n
    mine = dt.encode(inputs(r, c, count, dt))
    recv = full(count, dt)
    # Even ranks send first, odd ones receive first: no cycle of sends waiting for receives.
    if r % 2 == 0:
        comm.send(mine, right, tag=c)
        comm.recv(recv, left, tag=c)
    else:
        comm.recv(recv, left, tag=c)
        comm.send(mine, right, tag=c)
    chk.expect(f"send/recv ring n={count}", recv, inputs(left, c, count, dt), dt)


class DLPackOnly:
    """A producer with DLPack and no buffer protocol, as torch and jax arrays are."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def core_extras(comm, chk, next_case):
    n, r = comm.size, comm.rank
    f32 = DTYPES[0]

    # Async: several in flight, waited in order; a buffer only the Work references.
    c = next_case()

    def async_calls():
        a = f32.encode(inputs(r, c, 1000, f32))
        b = DTYPES[7].encode(inputs(r, c + 1, 77, DTYPES[7]))
        works = [comm.all_reduce_async(a, "sum"), comm.all_reduce(b, "max", async_op=True),
                 comm.all_reduce_async(f32.encode(np.full(5, r + 1.0)), "sum")]
        gc.collect()
        outs = [w.wait() for w in works]
        assert all(w.done() for w in works)
        chk.expect("async a", a, reduce_ref([inputs(k, c, 1000, f32) for k in range(n)],
                                            "sum", f32, n), f32)
        chk.expect("async b", b, reduce_ref([inputs(k, c + 1, 77, DTYPES[7]) for k in range(n)],
                                            "max", DTYPES[7], n), DTYPES[7])
        chk.expect("async dropped", outs[2], np.full(5, n * (n + 1) / 2), f32)
        w = comm.barrier_async()
        assert w.wait() is None

    chk.run("async", async_calls)

    # DLPack producers.
    c = next_case()

    def dlpack():
        a = f32.encode(inputs(r, c, 31, f32))
        comm.all_reduce(DLPackOnly(a), "sum")
        chk.expect("dlpack all_reduce", a, reduce_ref([inputs(k, c, 31, f32) for k in range(n)],
                                                      "sum", f32, n), f32)

    chk.run("dlpack", dlpack)

    # Python's own buffers.
    c = next_case()

    def builtin_buffers():
        b = bytearray([r + 1] * 5)
        comm.all_reduce(b, "max")
        assert list(b) == [n] * 5, list(b)
        m = memoryview(bytearray([1] * 3))
        comm.all_reduce(m, "sum")
        assert list(m) == [n] * 3, list(m)

    chk.run("bytearray/memoryview", builtin_buffers)

    # The packer: mixed dtypes, an empty array, buckets of 64 bytes.
    c = next_case()

    def packed():
        dts = [DTYPES[0], DTYPES[0], DTYPES[1], DTYPES[6], DTYPES[0], DTYPES[2]]
        sizes = [3, 0, 17, 40, 1000, 9]
        arrays = [dt.encode(inputs(r, c + i, s, dt)) for i, (dt, s) in enumerate(zip(dts, sizes))]
        collectives.packing.all_reduce(comm, arrays, "sum", bytes_per_pack=64)
        for i, (dt, s) in enumerate(zip(dts, sizes)):
            chk.expect(f"packing.all_reduce [{i}]", arrays[i],
                       reduce_ref([inputs(k, c + i, s, dt) for k in range(n)], "sum", dt, n), dt)
        arrays = [dt.encode(inputs(r, c + i, s, dt)) for i, (dt, s) in enumerate(zip(dts, sizes))]
        collectives.packing.broadcast_async(comm, arrays, root=n - 1).wait()
        for i, (dt, s) in enumerate(zip(dts, sizes)):
            chk.expect(f"packing.broadcast [{i}]", arrays[i], inputs(n - 1, c + i, s, dt), dt)

    chk.run("packing", packed)

    # A subgroup: ranks of one parity, ordered by descending rank.
    def subgroup():
        sub = comm.split(r % 2, key=n - r)
        members = [k for k in range(n) if k % 2 == r % 2]
        with sub:
            assert sub.size == len(members), (sub.size, members)
            assert sub.rank == sorted(members, reverse=True).index(r), sub.rank
            a = np.full(4, r + 1, np.int64)
            sub.all_reduce(a, "sum")
            assert list(a) == [sum(k + 1 for k in members)] * 4, list(a)
            b = np.zeros(sub.size, np.int32)
            sub.all_gather(np.array([r], np.int32), b)
            assert list(b) == sorted(members, reverse=True), list(b)

    chk.run("split", subgroup)


def scenario_matrix(implementation, groups):
    chk = Checker()
    start = time.monotonic()
    try:
        with collectives.Communication(implementation=implementation, timeout=30,
                                       small_message_bytes=4096, chunk_bytes=8192) as comm:
            matrix(comm, chk, groups.split(","))
    except collectives.Error as e:
        chk.failures.append(f"stopped: {type(e).__name__}: {e}")
    report(rank=RANK, cases=chk.cases, failures=chk.failures[:40],
           seconds=round(time.monotonic() - start, 2))


def scenario_mismatch():
    with collectives.Communication(timeout=20) as comm:
        count = 4 + comm.rank  # every rank a different count
        out = np.full(count, 5.0, np.float32)
        start = time.monotonic()
        try:
            comm.all_reduce(np.ones(count, np.float32), out=out)
            report(rank=RANK, error=None)
        except collectives.Error as e:
            report(rank=RANK, error=type(e).__name__, message=str(e),
                   seconds=time.monotonic() - start, untouched=bool((out == 5.0).all()))


def scenario_killed(implementation):
    comm = collectives.Communication(implementation=implementation, timeout=8)
    comm.barrier()
    if comm.rank == comm.size - 1:
        os._exit(3)  # dies without a word to its peers
    start = time.monotonic()
    try:
        for _ in range(100):
            comm.all_reduce(np.ones(1 << 16, np.float32))
        report(rank=RANK, error=None)
    except collectives.Error as e:
        report(rank=RANK, error=type(e).__name__, message=str(e), code=int(e.code),
               seconds=time.monotonic() - start)
    comm.abort()
    comm.close()


def scenario_file_store(path):
    """The ranks meet through a file store in `path` rather than rank 0's TCP store."""
    with collectives.Communication(store_path=path, timeout=20) as comm:
        a = np.full(5, comm.rank + 1, np.int32)
        comm.all_reduce(a, "sum")
        report(rank=RANK, values=a.tolist())


def scenario_timeout():
    """Rank 0 calls a collective that rank 1 never issues, with a 2-second deadline."""
    comm = collectives.Communication(timeout=30)
    comm.barrier()
    if comm.rank != 0:
        time.sleep(3.5)  # past rank 0's deadline, then leave
        return
    comm.set_timeout(2.0)
    start = time.monotonic()
    try:
        comm.all_reduce(np.ones(3, np.float32))
        report(rank=RANK, error=None)
    except TimeoutError as e:  # the builtin: collectives.TimeoutError derives from it
        report(rank=RANK, error=type(e).__name__, message=str(e),
               seconds=time.monotonic() - start)
    comm.abort()


def scenario_sigint(kind):
    """Rank 0 blocks in a collective that rank 1 never issues, or (kind "setup", launched alone)
    in the set-up that waits for it; the test sends SIGINT."""
    if kind == "setup":
        print("BLOCKING", flush=True)
        start = time.monotonic()
        try:
            collectives.Communication(timeout=120)
        except KeyboardInterrupt:
            report(rank=RANK, interrupted=True, seconds=time.monotonic() - start,
                   after="AbortedError")
            raise
        report(rank=RANK, interrupted=False)
        return
    comm = collectives.Communication(timeout=120)
    comm.barrier()
    if comm.rank != 0:
        time.sleep(60)
        return
    print("BLOCKING", flush=True)
    start = time.monotonic()
    try:
        if kind == "small":
            comm.all_reduce(np.ones(2, np.float32))
        elif kind == "large":
            comm.all_reduce(np.ones(1 << 20, np.float32))
        else:
            comm.all_reduce_async(np.ones(2, np.float32)).wait()
        report(rank=RANK, interrupted=False)
    except KeyboardInterrupt:
        seconds = time.monotonic() - start
        try:
            comm.barrier()
            after = None
        except collectives.Error as e:
            after = type(e).__name__
        report(rank=RANK, interrupted=True, seconds=seconds, after=after)
        raise


if __name__ == "__main__":
    name = sys.argv[1]
    if name == "matrix":
        scenario_matrix(sys.argv[2], sys.argv[3])
    elif name == "mismatch":
        scenario_mismatch()
    elif name == "killed":
        scenario_killed(sys.argv[2])
    elif name == "file_store":
        scenario_file_store(sys.argv[2])
    elif name == "timeout":
        scenario_timeout()
    elif name == "sigint":
        scenario_sigint(sys.argv[2])
    else:
        sys.exit(f"unknown scenario {name}")
