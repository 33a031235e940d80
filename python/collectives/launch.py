"""Starts N ranks of a Python program on this host, with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT
on a free loopback port; OMP_NUM_THREADS=1 unless set): what the examples and bench/torch_perf.py
use where `python3 -m torch.distributed.run` is not wanted."""

import os
import socket
import subprocess
import sys
import time

__all__ = ["run_local"]


def run_local(nproc, argv, env=None, timeout_s=None, name="launch"):
    """Runs `sys.executable argv...` as ranks 0..nproc-1 and waits for them. When one rank fails,
    the others get SIGTERM; past `timeout_s` seconds (None: no limit) every rank is killed.
    `env` adds variables to every rank's. Returns the first non-zero exit status, else 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                        LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), **(env or {}))
        rank_env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable] + list(argv), env=rank_env))
    status = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        pending = list(procs)
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                print(f"{name}: a job ran past {timeout_s:.0f} s; stopping it", file=sys.stderr)
                return 1
            for p in list(pending):
                rc = p.poll()
                if rc is None:
                    continue
                pending.remove(p)
                if rc != 0 and status == 0:
                    status = rc if rc > 0 else 1
                    for other in pending:
                        other.terminate()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return status
