"""Runs a job of real processes for the tests: `world` ranks of python/tests/_worker.py, each
with RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT, as torchrun would set them."""
import json
import os
import socket
import subprocess
import sys
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(world, scenario, *args, env=None, ranks=None, worker=WORKER):
    """Starts the ranks (those of `ranks`, default all) of `worker`; returns their Popen objects
    (stdout and stderr piped, text)."""
    port = free_port()
    procs = []
    for rank in range(world) if ranks is None else ranks:
        e = dict(os.environ)
        for name in ("TF_CONFIG", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
            e.pop(name, None)
        e.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), COLLECTIVES_JOB_ID=f"pytest-{scenario}-{port}")
        if env:
            e.update(env)
        procs.append(subprocess.Popen(
            [sys.executable, worker, scenario, *map(str, args)], env=e, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish(procs, timeout):
    """Waits for every rank (killing all of them past `timeout` seconds); returns, per rank,
    (returncode, the dict of its last 'RESULT ' line or None, stdout, stderr)."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            stdout, stderr = p.communicate()
            stderr += f"\n[killed after {timeout} s]"
        result = None
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        out.append((p.returncode, result, stdout, stderr))
    return out


def run(world, scenario, *args, timeout=60, env=None, worker=WORKER):
    return finish(start(world, scenario, *args, env=env, worker=worker), timeout)
