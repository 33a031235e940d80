"""Launching real processes for the torch backend's tests, and the inputs and references they
check against.

launch(fn, world) starts `world` spawned processes that each run fn(rank, world, *args) with
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE set (a free port), and returns what each returned
(or raises, naming the rank and its traceback, when one raised, died or outlived the deadline:
the test then fails, it never hangs). The functions live in this module so that the spawned
processes can import them.
"""

import json
import multiprocessing
import os
import socket
import tempfile
import time
import traceback

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"]
FLOATS = {"float32", "float64", "float16", "bfloat16"}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn, rank, world, port, path, args, env):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world)})
    os.environ.update(env)
    result = {}
    try:
        result["value"] = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001  (reported to the parent)
        result["error"] = traceback.format_exc()
    with open(path, "w") as out:
        json.dump(result, out)


def launch(fn, world, *args, timeout=60, env=None, allow_exit=()):
    """Runs fn(rank, world, *args) in `world` processes; returns the list of their values.
    Ranks in `allow_exit` may end without a result (a test that kills them)."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"{rank}.json") for rank in range(world)]
        procs = [ctx.Process(target=_entry,
                             args=(fn, rank, world, port, paths[rank], args, env or {}))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if hung:
            raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout} s")
        values = []
        for rank, path in enumerate(paths):
            if not os.path.exists(path):
                if rank in allow_exit:
                    values.append(None)
                    continue
                raise AssertionError(f"rank {rank} exited ({procs[rank].exitcode}) without a result")
            with open(path) as inp:
                result = json.load(inp)
            if "error" in result:
                raise AssertionError(f"rank {rank} raised:\n{result['error']}")
            values.append(result["value"])
        return values


# ---- Known inputs and references (plain torch on one process, in float64 or int64). ----

def value(rank, n, dtype, salt=0, op="sum"):
    """Rank `rank`'s input: small integers, so that sums and products are exact in every
    dtype (|sum| <= 20, products <= 81 on four ranks)."""
    import torch
    i = torch.arange(n, dtype=torch.int64)
    if op == "product":
        base = (i + rank + salt) % 3 + 1
    else:
        base = (i * 7 + rank * 13 + salt * 5) % 11 - 5
        if dtype == "uint8":
            base = base + 5
    return base.to(getattr(torch, dtype))


def reduce_ref(inputs, op, dtype):
    """op over ranks of `inputs`, computed wide and cast back (integer AVG truncates)."""
    import torch
    wide = torch.stack([t.to(torch.float64 if dtype in FLOATS else torch.int64) for t in inputs])
    world = len(inputs)
    if op == "sum":
        out = wide.sum(0)
    elif op == "product":
        out = wide.prod(0)
    elif op == "min":
        out = wide.min(0).values
    elif op == "max":
        out = wide.max(0).values
    elif op == "avg":
        out = wide.sum(0) / world if dtype in FLOATS else torch.div(wide.sum(0), world,
                                                                     rounding_mode="trunc")
    return out.to(getattr(torch, dtype))


def same(got, want, dtype, approx=False):
    import torch
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if approx and dtype in FLOATS:
        tol = 1e-2 if dtype in ("float16", "bfloat16") else 1e-6
        return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    return torch.equal(got, want)


# ---- The collective matrix: every op x dtype x size, checked on every rank. ----

def _init(rank, world, timeout=30, **kwargs):
    import datetime
    import torch.distributed as dist
    import collectives.torch  # noqa: F401  (registers the backend)
    dist.init_process_group("collectives", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)
    return dist


def _cases(rank, world, dist, dtype, n):
    """Yields (name, check) pairs; check() runs the collective and returns whether the result
    matches the reference. Every rank yields the same cases in the same order."""
    import torch
    v = lambda r, count=n, salt=0, op="sum": value(r, count, dtype, salt, op)  # noqa: E731
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
           "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    for name, op in ops.items():
        def all_reduce(name=name, op=op):
            t = v(rank, op=name)
            dist.all_reduce(t, op=op)
            return same(t, reduce_ref([v(r, op=name) for r in range(world)], name, dtype), dtype,
                        approx=name == "avg")
        yield f"all_reduce {name}", all_reduce

    def all_reduce_async():
        t = v(rank)
        work = dist.all_reduce(t, async_op=True)
        future = work.get_future()
        got = future.wait()[0]
        return (work.is_completed() and work.wait() and got.data_ptr() == t.data_ptr()
                and same(t, reduce_ref([v(r) for r in range(world)], "sum", dtype), dtype))
    yield "all_reduce async_op get_future", all_reduce_async

    def all_reduce_coalesced():
        ts = [v(rank), v(rank, n + 3, salt=1)]
        dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX)
        return (same(ts[0], reduce_ref([v(r) for r in range(world)], "max", dtype), dtype) and
                same(ts[1], reduce_ref([v(r, n + 3, 1) for r in range(world)], "max", dtype),
                     dtype))
    yield "all_reduce_coalesced max", all_reduce_coalesced

    for name, op in (("sum", ops["sum"]), ("min", ops["min"])):
        def reduce(name=name, op=op):
            t = v(rank)
            dist.reduce(t, dst=world - 1, op=op)
            want = reduce_ref([v(r) for r in range(world)], name, dtype) if rank == world - 1 \
                else v(rank)
            return same(t, want, dtype)
        yield f"reduce {name}", reduce

    def broadcast():
        t = v(rank)
        dist.broadcast(t, src=world - 1)
        return same(t, v(world - 1), dtype)
    yield "broadcast", broadcast

    everyone = lambda salt=0: torch.cat([v(r, salt=salt) for r in range(world)])  # noqa: E731

    def all_gather_separate():
        out = [torch.full((n,), 1, dtype=getattr(torch, dtype)) for _ in range(world)]
        dist.all_gather(out, v(rank))
        return same(torch.cat(out), everyone(), dtype)
    yield "all_gather (separate outputs)", all_gather_separate

    def all_gather_views():
        flat = torch.zeros(n * world, dtype=getattr(torch, dtype))
        out = list(flat.split(n)) if n else [flat[:0] for _ in range(world)]
        dist.all_gather(out, v(rank))
        return same(flat, everyone(), dtype)
    yield "all_gather (views of one buffer)", all_gather_views

    def all_gather_strided():
        # Outputs that are columns of one matrix: not contiguous, unpacked from a buffer.
        grid = torch.zeros(n, world, dtype=getattr(torch, dtype))
        dist.all_gather([grid[:, r] for r in range(world)], v(rank))
        return same(grid.t().reshape(-1), everyone(), dtype)
    yield "all_gather (strided outputs)", all_gather_strided

    def all_gather_into_tensor():
        out = torch.zeros(n * world, dtype=getattr(torch, dtype))
        dist.all_gather_into_tensor(out, v(rank))
        return same(out, everyone(), dtype)
    yield "all_gather_into_tensor", all_gather_into_tensor

    def all_gather_into_tensor_in_place():
        out = torch.zeros(n * world, dtype=getattr(torch, dtype))
        out[rank * n:(rank + 1) * n] = v(rank)
        dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
        return same(out, everyone(), dtype)
    yield "all_gather_into_tensor in place", all_gather_into_tensor_in_place

    def all_gather_coalesced():
        out = [[torch.zeros(n, dtype=getattr(torch, dtype)),
                torch.zeros(2, dtype=getattr(torch, dtype))] for _ in range(world)]
        dist.all_gather_coalesced(out, [v(rank), v(rank, 2, salt=3)])
        return all(same(out[r][0], v(r), dtype) and same(out[r][1], v(r, 2, 3), dtype)
                   for r in range(world))
    yield "all_gather_coalesced", all_gather_coalesced

    def reduce_scatter():
        out = torch.zeros(n, dtype=getattr(torch, dtype))
        dist.reduce_scatter(out, [v(rank, salt=j) for j in range(world)])
        return same(out, reduce_ref([v(r, salt=rank) for r in range(world)], "sum", dtype), dtype)
    yield "reduce_scatter", reduce_scatter

    def reduce_scatter_tensor(in_place=False):
        full = v(rank, n * world)
        out = full[rank * n:(rank + 1) * n] if in_place else torch.zeros(n, dtype=full.dtype)
        dist.reduce_scatter_tensor(out, full, op=ops["max"])
        want = reduce_ref([v(r, n * world) for r in range(world)], "max", dtype)
        return same(out, want[rank * n:(rank + 1) * n], dtype)
    yield "reduce_scatter_tensor max", reduce_scatter_tensor
    yield "reduce_scatter_tensor in place", lambda: reduce_scatter_tensor(True)

    def gather():
        root = 0
        out = [torch.zeros(n, dtype=getattr(torch, dtype)) for _ in range(world)] \
            if rank == root else None
        dist.gather(v(rank), out, dst=root)
        return rank != root or same(torch.cat(out), everyone(), dtype)
    yield "gather", gather

    def scatter():
        root = world - 1
        ins = [v(root, salt=j) for j in range(world)] if rank == root else None
        out = torch.zeros(n, dtype=getattr(torch, dtype))
        dist.scatter(out, ins, src=root)
        return same(out, v(root, salt=rank), dtype)
    yield "scatter", scatter

    def all_to_all_single():
        out = torch.zeros(n * world, dtype=getattr(torch, dtype))
        dist.all_to_all_single(out, v(rank, n * world))
        want = torch.cat([v(j, n * world)[rank * n:(rank + 1) * n] for j in range(world)])
        return same(out, want, dtype)
    yield "all_to_all_single", all_to_all_single

    def all_to_all_single_uneven():
        sends = lambda r: [(2 * r + j + n) % 3 for j in range(world)]  # noqa: E731
        mine = v(rank, sum(sends(rank)))
        recv_splits = [sends(j)[rank] for j in range(world)]
        out = torch.zeros(sum(recv_splits), dtype=getattr(torch, dtype))
        dist.all_to_all_single(out, mine, output_split_sizes=recv_splits,
                               input_split_sizes=sends(rank))
        want = torch.cat([v(j, sum(sends(j)))[sum(sends(j)[:rank]):sum(sends(j)[:rank + 1])]
                          for j in range(world)])
        return same(out, want, dtype)
    yield "all_to_all_single uneven", all_to_all_single_uneven

    def all_to_all():
        out = [torch.zeros(n, dtype=getattr(torch, dtype)) for _ in range(world)]
        dist.all_to_all(out, [v(rank, salt=j) for j in range(world)])
        return all(same(out[j], v(j, salt=rank), dtype) for j in range(world))
    yield "all_to_all", all_to_all

    if world > 1:
        def send_recv():
            # A chain (rank 0 sends first, every other rank receives first): no cycle of sends
            # waiting for receives queued behind them.
            out = torch.zeros(n, dtype=getattr(torch, dtype))
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            if rank == 0:
                dist.send(v(rank), nxt, tag=n)
                dist.recv(out, prv, tag=n)
            else:
                dist.recv(out, prv, tag=n)
                dist.send(v(rank), nxt, tag=n)
            return same(out, v(prv), dtype)
        yield "send/recv", send_recv

    yield "barrier", lambda: dist.barrier() is None


def matrix(rank, world, sizes, dtypes=DTYPES):
    """Runs every case on every dtype and size; returns the failures as strings."""
    dist = _init(rank, world)
    failures = []
    for dtype in dtypes:
        for n in sizes:
            for name, check in _cases(rank, world, dist, dtype, n):
                try:
                    if not check():
                        failures.append(f"rank {rank}: {name} {dtype} n={n}: wrong result")
                except Exception as error:  # noqa: BLE001  (every failure is reported)
                    failures.append(f"rank {rank}: {name} {dtype} n={n}: "
                                    f"{type(error).__name__}: {str(error).splitlines()[0]}")
                    if len(failures) > 40:
                        return failures
    dist.destroy_process_group()
    return failures


# ---- Workers for test_torch_backend.py. ----

def _sum_check(dist, group=None, ranks=None):
    """An all-reduce on `group` (its members: `ranks`) checked against the reference."""
    import torch
    me = dist.get_rank()
    t = value(me, 7, "float32")
    dist.all_reduce(t, group=group)
    return torch.equal(t, reduce_ref([value(r, 7, "float32") for r in ranks], "sum", "float32"))


def init_method(rank, world, how, where):
    """Initialises through `how` (env, tcp, file, tcp_store, file_store) and all-reduces once."""
    import datetime
    import torch.distributed as dist
    import collectives.torch  # noqa: F401
    timeout = datetime.timedelta(seconds=30)
    if how == "env":
        dist.init_process_group("collectives", init_method="env://", timeout=timeout)
    elif how == "tcp":
        dist.init_process_group("collectives", init_method=f"tcp://127.0.0.1:{where}",
                                rank=rank, world_size=world, timeout=timeout)
    elif how == "file":
        dist.init_process_group("collectives", init_method=f"file://{where}", rank=rank,
                                world_size=world, timeout=timeout)
    elif how == "tcp_store":
        store = dist.TCPStore("127.0.0.1", int(where), world, rank == 0, timeout)
        dist.init_process_group("collectives", store=store, rank=rank, world_size=world,
                                timeout=timeout)
    elif how == "file_store":
        store = dist.FileStore(where, world)
        dist.init_process_group("collectives", store=store, rank=rank, world_size=world,
                                timeout=timeout)
    ok = _sum_check(dist, ranks=range(world)) and dist.get_backend() == "collectives"
    dist.destroy_process_group()
    return ok


def direct_construction(rank, world, path):
    """A ProcessGroupCollectives built without init_process_group, over a FileStore."""
    import torch
    import torch.distributed as dist
    import collectives.torch as ct
    pg = ct.new_process_group(dist.FileStore(path, world), rank, world, timeout=30,
                              options=ct.Options("ring", chunk_bytes=4096))
    t = value(rank, 5000, "float64")
    pg.allreduce([t]).wait()
    want = reduce_ref([value(r, 5000, "float64") for r in range(world)], "sum", "float64")
    return [torch.equal(t, want), pg.implementation, pg.options.chunk_bytes]


def subgroups(rank, world):
    """Two disjoint groups and an overlapping one in one job, with their own options."""
    import collectives.torch as ct
    dist = _init(rank, world)
    low = dist.new_group([0, 1])
    high = dist.new_group([2, 3], pg_options=ct.Options("ring"))
    odd = dist.new_group([1, 2, 3])
    results = {"world": _sum_check(dist, ranks=range(world))}
    if rank in (0, 1):
        results["low"] = _sum_check(dist, low, [0, 1])
        results["low_impl"] = low.implementation
    else:
        results["high"] = _sum_check(dist, high, [2, 3])
        results["high_impl"] = high.implementation
    if rank in (1, 2, 3):
        results["odd"] = _sum_check(dist, odd, [1, 2, 3])
        import torch
        t = value(rank, 3, "int64")
        dist.broadcast(t, src=3, group=odd)  # src is a global rank
        results["odd_broadcast"] = torch.equal(t, value(3, 3, "int64"))
    results["world_again"] = _sum_check(dist, ranks=range(world))
    # The object collectives: all_gather and broadcast of uint8 and int64 tensors underneath.
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "text": "x" * rank})
    results["all_gather_object"] = gathered == [{"rank": r, "text": "x" * r} for r in range(world)]
    objects = [rank, "from rank %d" % rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(objects, src=1)
    results["broadcast_object_list"] = objects == [1, "from rank 1"]
    dist.destroy_process_group()
    return results


def options(rank, world):
    """pg_options, then set_options, then COLLECTIVES_* variables reach the communicator."""
    import collectives.torch as ct
    env_impl = None
    ct.set_options(ct.Options(chunk_bytes=8192))
    dist = _init(rank, world)
    pg = dist.group.WORLD
    env_impl = pg.implementation
    chunk = pg.options.chunk_bytes
    ok = _sum_check(dist, ranks=range(world))
    # pg_options win over set_options and the environment.
    group = dist.new_group(list(range(world)), pg_options=ct.Options("auto", chunk_bytes=16384))
    ok = ok and _sum_check(dist, group, range(world))
    mine = [group.implementation, group.options.chunk_bytes, group.inline_bytes]
    dist.destroy_process_group()
    ct.set_options(None)
    return [env_impl, chunk, ok] + mine


def async_work(rank, world):
    """Work.wait(timeout), is_completed, is_success, get_future with then(), in issue order."""
    import datetime
    import os
    import torch
    dist = _init(rank, world)
    # Blocking calls start no thread; the first get_future starts the group's completion thread.
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    dist.all_reduce(torch.ones(4))
    before = threads()
    for _ in range(50):
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4), async_op=True).wait()
    ok = [threads() == before]
    ts = [value(rank, 1000 * (i + 1), "float32") for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    chained = works[1].get_future().then(lambda f: f.value()[0] * 2)
    ok += [works[2].wait(timeout=datetime.timedelta(seconds=20)), works[0].wait()]
    ok.append(all(w.is_completed() and w.is_success() for w in works))
    wants = [reduce_ref([value(r, 1000 * (i + 1), "float32") for r in range(world)], "sum",
                        "float32") for i in range(3)]
    ok += [torch.equal(t, want) for t, want in zip(ts, wants)]
    ok.append(torch.equal(chained.wait(), wants[1] * 2))
    import time
    # A call that is only polled (no wait, no future) runs on the library's progress thread.
    for _ in range(3):
        t = torch.ones(2)
        work = dist.all_reduce(t, async_op=True)
        deadline = time.monotonic() + 20
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.0002)
        ok += [work.is_completed(), torch.equal(t, torch.full((2,), float(world)))]
    # wait(timeout) gives up on a call a peer has not issued yet; the call itself goes on.
    t = torch.ones(3)
    if rank == 1:
        time.sleep(1.0)
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        late = _raises(lambda: work.wait(timeout=datetime.timedelta(milliseconds=100)),
                       "did not complete")
        ok.append(not late.startswith(("did not raise", "wrong message")))
    ok += [work.wait(), torch.equal(t, torch.full((3,), float(world)))]
    dist.destroy_process_group()
    return ok


def _raises(fn, *words):
    try:
        fn()
    except RuntimeError as error:
        text = str(error)
        return text if all(w in text for w in words) else f"wrong message: {text}"
    return "did not raise"


def bad_arguments(rank, world):
    """Refusals name what was wrong, and leave the tensors untouched."""
    import torch
    dist = _init(rank, world)
    seen = {}
    t = torch.ones(4)
    for op in ("BAND", "BOR", "BXOR"):
        seen[op] = _raises(lambda: dist.all_reduce(t, op=getattr(dist.ReduceOp, op)), op)
    seen["bool"] = _raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool)), "Bool")
    seen["int16"] = _raises(lambda: dist.broadcast(torch.ones(3, dtype=torch.int16), 0), "Short")
    strided = torch.arange(16.0).reshape(4, 4).t()
    seen["non_contiguous"] = _raises(lambda: dist.all_reduce(strided), "not contiguous")
    seen["untouched"] = (torch.equal(strided, torch.arange(16.0).reshape(4, 4).t())
                         and torch.equal(t, torch.ones(4)))
    seen["any_source"] = _raises(lambda: dist.recv(torch.ones(2)), "any source")
    out = torch.zeros(2 * world - 1)
    seen["output_size"] = _raises(lambda: dist.all_gather_into_tensor(out, torch.ones(2)),
                                  "all_gather_into_tensor", f"expected {2 * world}")
    seen["list_length"] = _raises(lambda: dist.all_gather([torch.zeros(2)], torch.ones(2)),
                                  f"expects {world} output tensors")
    seen["root"] = _raises(lambda: dist.broadcast(torch.ones(2), src=world), "root")
    # A list with a tensor on another device than the input (meta: the only other device a
    # CPU-only torch has; c10d's ops do not dispatch a meta tensor alone to a backend).
    seen["list_device"] = _raises(
        lambda: dist.all_gather([torch.zeros(2)] * (world - 1) + [torch.empty(2, device="meta")],
                                torch.ones(2)), "not a dense tensor on cpu")
    seen["untouched_outputs"] = torch.equal(out, torch.zeros(2 * world - 1))
    # The group still works after refused calls.
    seen["works"] = _sum_check(dist, ranks=range(world))
    dist.destroy_process_group()
    return seen


def mismatch(rank, world):
    """Different sizes on two ranks: every rank raises the library's mismatch, nothing written."""
    import time
    import torch
    dist = _init(rank, world, timeout=20)
    t = torch.full((5 + rank,), 1.0)
    start = time.monotonic()
    message = _raises(lambda: dist.all_reduce(t), "match")
    elapsed = time.monotonic() - start
    untouched = torch.equal(t, torch.full((5 + rank,), 1.0))
    later = _raises(lambda: dist.all_reduce(torch.ones(2)))
    dist.destroy_process_group()
    return [message, elapsed, untouched, later]


def killed_rank(rank, world):
    """The last rank dies after init: every survivor raises within the 10 s timeout."""
    import os
    import time
    import torch
    dist = _init(rank, world, timeout=10)
    dist.all_reduce(torch.ones(4))
    if rank == world - 1:
        os._exit(3)
    start = time.monotonic()
    future = _raises(lambda: dist.all_reduce(torch.ones(1000), async_op=True).get_future().wait())
    message = _raises(lambda: dist.all_reduce(torch.ones(1000)))
    elapsed = time.monotonic() - start
    dist.destroy_process_group()
    return [message, future, elapsed]


def _ddp_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _ddp_data(step):
    import torch
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)


def ddp(rank, world, backend, port=None):
    """Trains 5 steps with DistributedDataParallel on `backend` (its store on `port` when
    given); returns the weights and those of one process training on the global batch."""
    import datetime
    import os
    import torch
    import torch.distributed as dist
    import collectives.torch  # noqa: F401
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=30))
    model = torch.nn.parallel.DistributedDataParallel(_ddp_model(), bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = _ddp_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    per = 16 // world
    for step in range(5):
        x, y = _ddp_data(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]),
                                     y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    got = [p.detach().reshape(-1).tolist() for p in model.module.parameters()]
    want = [p.detach().reshape(-1).tolist() for p in reference.parameters()]
    dist.destroy_process_group()
    return [got, want]


def ddp_versus_gloo(rank, world, gloo_port):
    """DDP's weights on "collectives", then on "gloo", in the same processes."""
    ours, reference = ddp(rank, world, "collectives")
    gloo, _ = ddp(rank, world, "gloo", gloo_port)
    return [ours, gloo, reference]
