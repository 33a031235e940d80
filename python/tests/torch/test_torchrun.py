"""The backend under PyTorch's own launcher: `python3 -m torch.distributed.run` starts 2 ranks,
each of which calls init_process_group("collectives") with env:// and all-reduces."""

import os
import socket
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import collectives.torch
    dist.init_process_group("collectives")
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    expected = dist.get_world_size() * (dist.get_world_size() + 1) / 2
    assert torch.all(t == expected), (dist.get_rank(), t[:4])
    print(f"ok rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_distributed_run_launches_the_backend(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    # --redirects/--tee: Debian's torch 1.13 under Python 3.11 cannot parse their defaults (0).
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--redirects", "1", "--tee", "1", str(script)],
        env=env, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"ok rank {rank}" in result.stdout, result.stdout + result.stderr
