"""Every collective between real processes (python/tests/_worker.py), checked against numpy on
every rank: each op, dtype and size (0, 1, a prime, one past small_message_bytes and many
chunks), in place and out of place, async, DLPack, the packer and a split; then the failures a
job meets: a mismatch, a killed rank and Ctrl-C."""
import signal
import time

import pytest

import _launch

# One job per world size and implementation runs the whole matrix.
JOBS = [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (2, "ring"), (3, "ring"), (4, "ring")]


def _describe(results):
    lines = []
    for rank, (rc, result, stdout, stderr) in enumerate(results):
        lines.append(f"rank {rank}: exit {rc}, result {result}")
        if rc != 0 or result is None:
            lines.append(stderr[-3000:])
    return "\n".join(lines)


@pytest.mark.parametrize("world,implementation", JOBS)
def test_matrix(world, implementation):
    results = _launch.run(world, "matrix", implementation, "core,rooted", timeout=60)
    text = _describe(results)
    for rc, result, _, _ in results:
        assert rc == 0 and result is not None, text
        assert result["failures"] == [], text
        assert result["cases"] > 500, text


def test_mismatch_raises_on_every_rank_and_writes_nothing():
    results = _launch.run(2, "mismatch", timeout=30)
    text = _describe(results)
    for rc, result, _, _ in results:
        assert rc == 0 and result is not None, text
        assert result["error"] == "MismatchError", text
        assert result["untouched"], text
        assert result["seconds"] < 10, text


@pytest.mark.parametrize("implementation", ["auto", "ring"])
def test_killed_rank_every_survivor_raises_within_the_timeout(implementation):
    results = _launch.run(3, "killed", implementation, timeout=40)
    text = _describe(results)
    assert results[2][0] == 3, text
    for rc, result, _, _ in results[:2]:
        assert rc == 0 and result is not None, text
        assert result["error"] in ("PeerLostError", "AbortedError", "TimeoutError"), text
        assert result["seconds"] < 8 + 3, text


def test_file_store_rendezvous(tmp_path):
    results = _launch.run(3, "file_store", str(tmp_path / "store"), timeout=40)
    for rc, result, _, stderr in results:
        assert rc == 0 and result is not None, stderr
        assert result["values"] == [6] * 5, result


def test_a_peer_that_never_comes_raises_timeout_error():
    results = _launch.run(2, "timeout", timeout=40)
    rc, result, _, stderr = results[0]
    assert rc == 0 and result is not None, stderr
    assert result["error"] == "TimeoutError", result
    assert 2 <= result["seconds"] < 5, result


@pytest.mark.parametrize("kind", ["small", "large", "wait", "setup"])
def test_ctrl_c_interrupts_a_blocked_call(kind):
    # "setup": rank 1 never starts, so rank 0 waits in the constructor.
    procs = _launch.start(2, "sigint", kind, ranks=[0] if kind == "setup" else None)
    try:
        line = procs[0].stdout.readline()  # "BLOCKING", once rank 0 is about to block
        assert line.strip() == "BLOCKING", procs[0].stderr.read()
        time.sleep(0.5)
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGINT)
        procs[0].wait(timeout=5)
        elapsed = time.monotonic() - sent
    finally:
        procs[-1].kill()
    results = _launch.finish(procs, timeout=10)
    rc, result, _, stderr = results[0]
    assert result is not None and result["interrupted"], stderr
    assert "KeyboardInterrupt" in stderr, stderr
    assert "Segmentation fault" not in stderr and "core dumped" not in stderr, stderr
    assert rc == -signal.SIGINT, rc
    assert elapsed < 3, elapsed
    # The communicator is aborted: a later call raises at once.
    assert result["after"] == "AbortedError", result
