"""examples/python/ddp_fashion_mnist.py with 2 processes: DDP leaves bit-identical weights on
every rank, and 30 steps agree within 1e-5 with one process training on the global batch.

Run with the package on PYTHONPATH (ctest sets it): each backend's case is one short run of the
example, which checks both properties itself and exits non-zero when either fails.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("numpy")

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "python" / "ddp_fashion_mnist.py"
DATA_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
STEPS = 30
TOLERANCE = 1e-5


def collectives_torch_available():
    try:
        return importlib.util.find_spec("collectives.torch") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not (DATA_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST is missing (Debian package dataset-fashion-mnist)")
@pytest.mark.parametrize("backend", ["gloo", "collectives"])
def test_ddp_two_processes_match_single_process(backend, tmp_path):
    if backend == "collectives" and not collectives_torch_available():
        pytest.skip("collectives.torch is not built (COLLECTIVES_BUILD_TORCH)")
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--nproc", "2", "--backend", backend,
         "--steps", str(STEPS), "--check-single", "--tolerance", str(TOLERANCE),
         "--timeout", "60", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())
    assert result["backend"] == backend
    assert result["world_size"] == 2
    assert result["steps"] == STEPS
    assert result["weights_identical"], run.stdout
    assert result["single_max_difference"] <= TOLERANCE, run.stdout
    # 30 steps of Adam move a Glorot-initialised model well above chance (0.1).
    assert result["test_accuracy"] > 0.5, run.stdout


@pytest.mark.skipif(not (DATA_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST is missing (Debian package dataset-fashion-mnist)")
def test_no_sync_skips_gradient_synchronisation(tmp_path):
    # Different shards without synchronised gradients leave different weights on each rank.
    out = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--nproc", "2", "--backend", "gloo", "--steps", "3",
         "--no-sync", "--timeout", "60", "--json", str(out)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())
    assert result["no_sync"] and not result["weights_identical"], run.stdout
