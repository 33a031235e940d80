#!/usr/bin/python3
"""torch_perf: torch.distributed collectives, backend "collectives" beside "gloo", nccl-tests style.

One command starts everything on this host (each backend in its own job of N processes, so that
one backend's threads never share the cores with the other's measurement):

  PYTHONPATH=build/python /usr/bin/python3 bench/torch_perf.py --nproc 2
  bench/torch_perf.py --nproc 4 -c all_reduce -b 1M -e 64M -f 4 --backends collectives:ring,gloo
  bench/torch_perf.py --nproc 2 --quick --csv torch_perf.csv

Under a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun, one process
per rank), the job measures the listed backends one after the other in the same processes.

Per collective and size: a check round with known inputs (#wrong: elements that differ from the
exact result, summed over ranks), warm-up rounds, then timed rounds (as many as fit in --time,
within --min-iters..--max-iters). time = the slowest rank's mean time per round; algbw = size /
time; busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter, all_to_all,
gather, scatter), x 1 (broadcast, reduce, sendrecv). size is the whole buffer as nccl-tests
counts it: the output of all_gather and gather, the input of reduce_scatter and scatter, each
rank's buffer of all_to_all, one message of sendrecv (ranks 2k and 2k+1 ping-pong; time is half
a round trip). float32, sum. Timing and checks travel over a separate Gloo group.

A backend entry is NAME or collectives:IMPL; IMPL sets COLLECTIVES_IMPLEMENTATION for that
job (auto, ring, ...). Ratio columns compare each backend with the entry "gloo" of the same run:
busbw ours/gloo (> 1: faster than Gloo).

Exit status: 0 when every check round was right; 1 when any element was wrong or a job failed;
2 on a bad command line.
"""

import argparse
import csv
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time

COLLECTIVES = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "reduce", "gather", "scatter", "barrier", "sendrecv"]
IMPL_ENV = "COLLECTIVES_IMPLEMENTATION"
ELEMENT_BYTES = 4  # float32


def parse_bytes(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = t[-1] if t and t[-1] in units else ""
    number = t[:-1] if suffix else t
    try:
        value = int(float(number) * units[suffix])
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (8, 64K, 1M, 64M)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"'{text}': a size is at least 0")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="torch.distributed busbw per collective, backend collectives beside gloo "
        "(nccl-tests columns)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2,
                   help="processes on this host per backend (without an outside launcher)")
    p.add_argument("--backends", default="collectives,gloo",
                   help="comma-separated: gloo, collectives, collectives:IMPL (sets "
                   f"{IMPL_ENV}=IMPL for that job)")
    p.add_argument("-c", "--collectives", default="all",
                   help="comma-separated from " + ", ".join(COLLECTIVES) + "; or all")
    p.add_argument("-b", "--min-bytes", type=parse_bytes, default=8, help="smallest size")
    p.add_argument("-e", "--max-bytes", type=parse_bytes,
                   help="largest size (default 64M; 16M with --quick)")
    p.add_argument("-f", "--factor", type=float,
                   help="size multiplier per step (default 2; 8 with --quick)")
    p.add_argument("-w", "--warmup-iters", type=int, default=3, help="untimed rounds per size")
    p.add_argument("--min-iters", type=int, default=5, help="fewest timed rounds per size")
    p.add_argument("--max-iters", type=int, default=1000, help="most timed rounds per size")
    p.add_argument("--time", type=float,
                   help="seconds of timed rounds to aim for per size (default 0.2; 0.05 with "
                   "--quick)")
    p.add_argument("-r", "--repeat", type=int, default=1,
                   help="rounds of timed calls per size; the median round is reported")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the backends' jobs this many times, interleaved; each row keeps "
                   "its fastest job (on a shared machine, the least disturbed)")
    p.add_argument("--quick", action="store_true",
                   help="a short sweep: the defaults -f 8 -e 16M --time 0.05")
    p.add_argument("--csv", metavar="FILE", help="write every row to FILE as CSV")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every job's environment (repeatable), e.g. a COLLECTIVES_* knob")
    p.add_argument("--timeout", type=float, default=120,
                   help="seconds a collective waits for its peers")
    p.add_argument("--rows-out", help=argparse.SUPPRESS)  # a job's rows, for the parent
    args = p.parse_args(argv)
    if args.factor is None:
        args.factor = 8.0 if args.quick else 2.0
    if args.max_bytes is None:
        args.max_bytes = (16 if args.quick else 64) << 20
    if args.time is None:
        args.time = 0.05 if args.quick else 0.2
    args.collectives = COLLECTIVES if args.collectives == "all" else \
        [c.strip() for c in args.collectives.split(",") if c.strip()]
    for c in args.collectives:
        if c not in COLLECTIVES:
            p.error(f"-c: unknown collective '{c}' ({', '.join(COLLECTIVES)} or all)")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in args.backends:
        name, _, impl = b.partition(":")
        if name not in ("gloo", "collectives") or (impl and name != "collectives"):
            p.error(f"--backends: '{b}' is not gloo, collectives or collectives:IMPL")
    if not args.backends:
        p.error("--backends: none given")
    if args.nproc < 1:
        p.error(f"--nproc {args.nproc}: must be at least 1")
    if args.factor <= 1.0:
        p.error(f"-f {args.factor}: must be greater than 1")
    if args.min_bytes > args.max_bytes:
        p.error(f"-b {args.min_bytes} is more than -e {args.max_bytes}")
    if args.repeat < 1 or args.jobs < 1:
        p.error("--repeat and --jobs: at least 1")
    if args.min_iters < 1 or args.max_iters < args.min_iters or args.warmup_iters < 0:
        p.error("need 0 <= --warmup-iters and 1 <= --min-iters <= --max-iters")
    for kv in args.env:
        if "=" not in kv:
            p.error(f"--env '{kv}': expected KEY=VALUE")
    return args


def sizes(args):
    out, size = [], args.min_bytes
    while size <= args.max_bytes:
        out.append(int(size))
        size = max(int(size) + 1, int(round(size * args.factor)))
    return out


def bus_factor(collective, n):
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                      "gather", "scatter"):
        return (n - 1) / n
    return 1.0


# ---- One job: the measurement on every rank ----------------------------------------------------

class Case:
    """Buffers and one round of a collective of `count` float32 elements in all over `group`;
    check() runs a round on known inputs and returns the wrong elements on this rank."""

    def __init__(self, torch, dist, collective, count, group, rank, n):
        self.torch, self.dist, self.c, self.count = torch, dist, collective, count
        self.group, self.rank, self.n = group, rank, n
        self.per = count // n if collective in ("all_gather_into_tensor", "reduce_scatter_tensor",
                                                "all_to_all_single", "gather",
                                                "scatter") else count
        self.peer = rank ^ 1 if (rank ^ 1) < n else None
        z = lambda k: torch.zeros(k, dtype=torch.float32)  # noqa: E731
        c = collective
        if c in ("all_reduce", "broadcast", "reduce", "sendrecv"):
            self.buf = z(count)
        elif c == "all_gather_into_tensor":
            self.inp, self.out = z(self.per), z(self.per * n)
        elif c == "reduce_scatter_tensor":
            self.inp, self.out = z(self.per * n), z(self.per)
        elif c == "all_to_all_single":
            self.inp, self.out = z(self.per * n), z(self.per * n)
        elif c == "gather":
            self.inp = z(self.per)
            self.out = [z(self.per) for _ in range(n)] if rank == 0 else None
        elif c == "scatter":
            self.out = z(self.per)
            self.inp = [z(self.per) for _ in range(n)] if rank == 0 else None
        self.note = ""
        self.run = self._resolve()

    def _resolve(self):
        d, g, c = self.dist, self.group, self.c
        if c == "all_reduce":
            return lambda: d.all_reduce(self.buf, group=g)
        if c == "broadcast":
            return lambda: d.broadcast(self.buf, src=0, group=g)
        if c == "reduce":
            return lambda: d.reduce(self.buf, dst=0, group=g)
        if c == "all_gather_into_tensor":
            native = getattr(d, "all_gather_into_tensor", None) or d._all_gather_base
            return lambda: native(self.out, self.inp, group=g)
        if c == "reduce_scatter_tensor":
            native = getattr(d, "reduce_scatter_tensor", None) or d._reduce_scatter_base
            return lambda: native(self.out, self.inp, group=g)
        if c == "all_to_all_single":
            return lambda: d.all_to_all_single(self.out, self.inp, group=g)
        if c == "gather":
            return lambda: d.gather(self.inp, self.out, dst=0, group=g)
        if c == "scatter":
            return lambda: d.scatter(self.out, self.inp, src=0, group=g)
        if c == "barrier":
            return lambda: d.barrier(group=g)
        if c == "sendrecv":
            return self._pingpong
        raise AssertionError(c)

    def fallback(self):
        """The list form of all_gather where the tensor form is unsupported (Gloo)."""
        if self.c != "all_gather_into_tensor":
            return False
        views = list(self.out.view(self.n, self.per))
        self.run = lambda: self.dist.all_gather(views, self.inp, group=self.group)
        self.note = "list form"
        return True

    def _pingpong(self):
        if self.peer is None:
            return
        d = self.dist
        if self.rank % 2 == 0:
            d.send(self.buf, self.peer, group=self.group)
            d.recv(self.buf, self.peer, group=self.group)
        else:
            d.recv(self.buf, self.peer, group=self.group)
            d.send(self.buf, self.peer, group=self.group)

    def check(self):
        t, r, n, per, c = self.torch, self.rank, self.n, self.per, self.c
        i = lambda k: t.arange(k, dtype=t.float32)  # noqa: E731
        pattern = lambda k: (t.arange(k) % 7 + 1).to(t.float32)  # noqa: E731
        wrong = lambda got, want: int((got != want).sum().item())  # noqa: E731
        if c == "all_reduce":
            self.buf.copy_(pattern(self.count) * (r + 1))
            self.run()
            out = wrong(self.buf, pattern(self.count) * (n * (n + 1) // 2))
        elif c == "broadcast":
            self.buf.copy_(i(self.count) % 101 if r == 0 else t.full((self.count,), -1.0))
            self.run()
            out = wrong(self.buf, i(self.count) % 101)
        elif c == "reduce":
            self.buf.copy_(pattern(self.count) * (r + 1))
            self.run()
            out = wrong(self.buf, pattern(self.count) * (n * (n + 1) // 2)) if r == 0 else 0
        elif c == "all_gather_into_tensor":
            self.inp.copy_(i(per) % 97 + 1000 * r)
            self.out.fill_(-1)
            self.run()
            want = t.cat([i(per) % 97 + 1000 * j for j in range(n)])
            out = wrong(self.out, want)
        elif c == "reduce_scatter_tensor":
            self.inp.copy_(pattern(per * n) * (r + 1))
            self.out.fill_(-1)
            self.run()
            want = pattern(per * n)[r * per:(r + 1) * per] * (n * (n + 1) // 2)
            out = wrong(self.out, want)
        elif c == "all_to_all_single":
            self.inp.copy_(t.cat([i(per) % 5 + 100 * r + j for j in range(n)]))
            self.out.fill_(-1)
            self.run()
            out = wrong(self.out, t.cat([i(per) % 5 + 100 * j + r for j in range(n)]))
        elif c == "gather":
            self.inp.copy_(i(per) % 97 + 1000 * r)
            if r == 0:
                for o in self.out:
                    o.fill_(-1)
            self.run()
            out = sum(wrong(o, i(per) % 97 + 1000 * j) for j, o in enumerate(self.out)) \
                if r == 0 else 0
        elif c == "scatter":
            if r == 0:
                for j, x in enumerate(self.inp):
                    x.copy_(i(per) % 97 + 1000 * j)
            self.out.fill_(-1)
            self.run()
            out = wrong(self.out, i(per) % 97 + 1000 * r)
        elif c == "sendrecv":
            # Each rank of a pair sends its own pattern once and receives its peer's.
            if self.peer is None:
                return 0
            d, g = self.dist, self.group
            mine, theirs = i(self.count) % 11 + 10 * r, t.full((self.count,), -1.0)
            if r % 2 == 0:
                d.send(mine, self.peer, group=g)
                d.recv(theirs, self.peer, group=g)
            else:
                d.recv(theirs, self.peer, group=g)
                d.send(mine, self.peer, group=g)
            out = wrong(theirs, i(self.count) % 11 + 10 * self.peer)
        else:  # barrier
            self.run()
            out = 0
        self.zero()
        return out

    def zero(self):
        """Zeros in every buffer: repeated in-place sums then stay finite and exact."""
        for name in ("buf", "inp", "out"):
            v = getattr(self, name, None)
            for x in (v if isinstance(v, list) else [v] if v is not None else []):
                x.zero_()


def element_count(collective, size, n):
    if collective == "barrier":
        return 0
    count = max(1, size // ELEMENT_BYTES)
    if collective in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                      "gather", "scatter"):
        count = max(n, count // n * n)
    return count


def measure_backend(args, label, torch, dist, meta, rank, n):
    timeout = datetime.timedelta(seconds=args.timeout)
    name = label.partition(":")[0]
    group = dist.new_group(backend=name, timeout=timeout)
    rows = []
    stat = torch.zeros(2, dtype=torch.float64)
    for collective in args.collectives:
        if collective == "sendrecv" and n < 2:
            continue
        size_list = [0] if collective == "barrier" else sizes(args)
        if rank == 0:
            print(f"# {label}: {collective}", flush=True)
        for size in size_list:
            count = element_count(collective, size, n)
            case = Case(torch, dist, collective, count, group, rank, n)
            status = "ok"
            try:
                wrong = case.check()
            except RuntimeError as e:
                if not case.fallback():
                    raise_if_not_unsupported(e)
                    status = "unsupported"
                    wrong = 0
                else:
                    wrong = case.check()
            # Every rank agrees on support, on the wrong count and on the number of rounds.
            stat[0], stat[1] = float(wrong), 1.0 if status != "ok" else 0.0
            dist.all_reduce(stat, group=meta)
            wrong, unsupported = int(stat[0].item()), stat[1].item() > 0
            row = {"backend": label, "collective": collective, "world_size": n,
                   "size_bytes": count * ELEMENT_BYTES, "count": count, "dtype": "float32",
                   "op": "sum" if collective in ("all_reduce", "reduce",
                                                 "reduce_scatter_tensor") else "none",
                   "root": 0 if collective in ("broadcast", "reduce", "gather", "scatter")
                   else -1, "note": case.note}
            if unsupported:
                row.update(time_us=None, algbw_gbps=None, busbw_gbps=None, wrong=None,
                           note=status if status != "ok" else "unsupported on another rank")
                rows.append(row)
                report_row(rank, row)
                continue
            t0 = time.perf_counter()
            for _ in range(args.warmup_iters):
                case.run()
            per_round = (time.perf_counter() - t0) / max(1, args.warmup_iters)
            stat[0], stat[1] = per_round, 0.0
            dist.all_reduce(stat, op=dist.ReduceOp.MAX, group=meta)
            iters = int(min(args.max_iters, max(args.min_iters,
                                                math.ceil(args.time / max(stat[0].item(), 1e-9)))))
            round_times = []
            for _ in range(args.repeat):
                dist.barrier(group=meta)
                t0 = time.perf_counter()
                for _ in range(iters):
                    case.run()
                stat[0], stat[1] = (time.perf_counter() - t0) / iters, 0.0
                dist.all_reduce(stat, op=dist.ReduceOp.MAX, group=meta)
                round_times.append(stat[0].item())
            seconds = sorted(round_times)[len(round_times) // 2]
            seconds /= 2 if collective == "sendrecv" else 1
            algbw = row["size_bytes"] / seconds / 1e9 if seconds > 0 else 0.0
            row.update(time_us=seconds * 1e6, algbw_gbps=algbw,
                       busbw_gbps=algbw * bus_factor(collective, n), wrong=wrong, iters=iters)
            rows.append(row)
            report_row(rank, row)
    dist.destroy_process_group(group)
    return rows


def raise_if_not_unsupported(error):
    text = str(error).lower()
    if "support" not in text and "implement" not in text:
        raise error


def report_row(rank, row):
    if rank != 0:
        return
    if row["time_us"] is None:
        print(f"  {row['size_bytes']:>12}  {row['note']}", flush=True)
    else:
        print(f"  {row['size_bytes']:>12} {row['count']:>12} {row['time_us']:>11.2f} "
              f"{row['algbw_gbps']:>9.3f} {row['busbw_gbps']:>9.3f} {row['wrong']:>6}"
              f"{'  (' + row['note'] + ')' if row['note'] else ''}", flush=True)


def worker(args):
    import torch
    import torch.distributed as dist
    if any(b.startswith("collectives") for b in args.backends):
        import collectives.torch  # noqa: F401  (registers the backend "collectives")
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)  # timing and checks
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for label in args.backends:
        rows += measure_backend(args, label, torch, dist, dist.group.WORLD, rank, n)
    if rank == 0 and args.rows_out:
        with open(args.rows_out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()
    return rows


# ---- The parent: one job per backend, then the tables ------------------------------------------

def launch(nproc, argv, env_extra, timeout_s):
    """Runs this script as ranks 0..nproc-1 on this host (collectives.launch.run_local)."""
    from collectives.launch import run_local
    return run_local(nproc, [os.path.abspath(__file__)] + argv, env=env_extra,
                     timeout_s=timeout_s, name="torch_perf")


def fmt(value, spec, width):
    return f"{value:{width}{spec}}" if value is not None else f"{'n/a':>{width}}"


def print_tables(args, rows, labels, n):
    base = "gloo" if "gloo" in labels else None
    ours = [b for b in labels if b != base] if base else []
    by = {(r["backend"], r["collective"], r["size_bytes"]): r for r in rows}
    for collective in args.collectives:
        keys = sorted({r["size_bytes"] for r in rows if r["collective"] == collective})
        if not keys:
            continue
        redop = "sum" if collective in ("all_reduce", "reduce", "reduce_scatter_tensor") else "none"
        print(f"\n# {collective}: {n} processes, float32, {redop}; busbw = algbw x "
              f"{bus_factor(collective, n):.3g}")
        head1 = f"#{'size':>11} {'count':>11}  {'type':>5} {'redop':>5} {'root':>4}"
        head2 = f"#{'(B)':>11} {'(elements)':>11}  {'':>5} {'':>5} {'':>4}"
        for b in labels:
            head1 += f"  {b[:34]:>34}"
            head2 += f"  {'time us':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        for b in ours:
            head1 += f"  {'busbw ' + b[:16] + '/gloo':>29}"
            head2 += f"  {'':>29}"
        print(head1)
        print(head2)
        for size in keys:
            some = next(by[(b, collective, size)] for b in labels if (b, collective, size) in by)
            line = (f" {size:>11} {some['count']:>11}  {'float':>5} {redop:>5} "
                    f"{some['root']:>4}")
            for b in labels:
                r = by.get((b, collective, size)) or {}
                line += (f"  {fmt(r.get('time_us'), '.2f', 10)}"
                         f" {fmt(r.get('algbw_gbps'), '.3f', 7)}"
                         f" {fmt(r.get('busbw_gbps'), '.3f', 7)} {fmt(r.get('wrong'), 'd', 6)}")
            for b in ours:
                r, g = by.get((b, collective, size)), by.get((base, collective, size))
                ratio = None
                if r and g and r["time_us"] and g["time_us"]:
                    ratio = g["time_us"] / r["time_us"]
                    r["busbw_ratio_over_gloo"] = ratio
                line += f"  {fmt(ratio, '.2f', 29)}"
            notes = sorted({f"{b}: {r['note']}" for b in labels
                            for r in [by.get((b, collective, size))] if r and r["note"]})
            print(line + (f"   # {'; '.join(notes)}" if notes else ""))


def write_csv(path, rows):
    fields = ["backend", "collective", "world_size", "size_bytes", "count", "dtype", "op",
              "root", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "iters",
              "busbw_ratio_over_gloo", "note"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})


def parent(args, argv):
    import torch
    env_extra = dict(kv.split("=", 1) for kv in args.env)
    print(f"# torch_perf: torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.node()}, {os.cpu_count()} cores; {args.nproc} processes per backend, "
          f"each backend in its own job")
    print(f"# sizes {args.min_bytes} B to {args.max_bytes} B, factor {args.factor:g}; "
          f"{args.warmup_iters} warm-up rounds, timed rounds for ~{args.time:g} s "
          f"({args.min_iters}..{args.max_iters}), median of {args.repeat} round(s), fastest of "
          f"{args.jobs} job(s); time = the slowest rank's mean")
    print("# busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter, "
          "all_to_all, gather, scatter), x 1 (broadcast, reduce, sendrecv: half a round trip)")
    if env_extra:
        print("# environment: " + " ".join(f"{k}={v}" for k, v in env_extra.items()))
    status = 0
    passthrough = strip_parent_options(argv)
    best = {}
    for job, label in [(j, b) for j in range(args.jobs) for b in args.backends]:
        name, _, impl = label.partition(":")
        env = dict(env_extra)
        if impl:
            env[IMPL_ENV] = impl
        print(f"# job {job + 1}/{args.jobs}: backend {label}" +
              (f" ({IMPL_ENV}={impl})" if impl else ""), flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            rc = launch(args.nproc, passthrough + ["--backends", label, "--rows-out", out], env,
                        timeout_s=max(600.0, args.timeout * 4))
            if rc != 0 or not os.path.exists(out):
                print(f"torch_perf: backend {label}: the job failed (exit status {rc})",
                      file=sys.stderr)
                status = 1
                continue
            with open(out) as f:
                for r in json.load(f):
                    key = (r["backend"], r["collective"], r["size_bytes"])
                    old = best.get(key)
                    if old is None or (r["time_us"] is not None and
                                       (old["time_us"] is None or r["time_us"] < old["time_us"])):
                        r["wrong"] = max(r["wrong"] or 0, (old or {}).get("wrong") or 0) \
                            if r["time_us"] is not None else None
                        best[key] = r
                    elif r.get("wrong"):
                        old["wrong"] = max(old["wrong"] or 0, r["wrong"])
    rows = list(best.values())
    labels = [b for b in args.backends if any(r["backend"] == b for r in rows)]
    if rows:
        print_tables(args, rows, labels, args.nproc)
    if args.csv:
        write_csv(args.csv, rows)
        print(f"# CSV: {args.csv}")
    if any(r.get("wrong") for r in rows):
        print("torch_perf: FAIL: some check rounds had wrong elements (#wrong)", file=sys.stderr)
        status = 1
    return status


def strip_parent_options(argv):
    """argv without the options only the parent acts on (each job gets its own --backends)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--backends", "--csv", "--nproc", "--rows-out", "--jobs"):
            skip = True
            continue
        if a.startswith(("--backends=", "--csv=", "--nproc=", "--rows-out=", "--jobs=")):
            continue
        out.append(a)
    return out


def main(argv):
    args = parse_args(argv)
    if "RANK" in os.environ:
        worker(args)
        return 0
    if any(b.startswith("collectives") for b in args.backends):
        try:
            import collectives.torch  # noqa: F401
        except ImportError as e:
            print(f"torch_perf: cannot import collectives.torch ({e}): build the torch backend "
                  "and set PYTHONPATH=build/python, or pass --backends gloo", file=sys.stderr)
            return 2
    return parent(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
