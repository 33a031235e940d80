"""CUDA buffers in the numpy module, against the CUDA runtime on the dynamic linker's path: on a
machine without a GPU the CPU stand-in tests/nccl/fake/fake_cuda_nccl.cc (ctest puts it there;
label fake_nccl), which models CUDA's and NCCL's contracts and proves nothing about a real GPU.
RING and AUTO stage device buffers between real processes (the stand-in's devices are per
process), world sizes 1 to 4; NCCL runs its ranks as threads of one process, as the stand-in
models it; without a usable runtime CUDA buffers are refused before anything is issued."""
import os

import numpy as np
import pytest

import _fake_cuda
import _launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cuda_worker.py")

needs_cuda = pytest.mark.skipif(_fake_cuda.runtime() is None and
                                os.environ.get("COLLECTIVES_REQUIRE_GPU") != "1",
                                reason="no libcudart.so.13 on the dynamic linker's path")


def _describe(results):
    return "\n".join(f"rank {r}: exit {rc}, result {res}\n{err[-3000:]}"
                     for r, (rc, res, _, err) in enumerate(results))


# Small staging slots, so that most buffers cross several segments.
STAGING = {"COLLECTIVES_CUDA_STAGING_BYTES": "4096"}


@needs_cuda
@pytest.mark.parametrize("world,implementation",
                         [(1, "ring"), (2, "ring"), (3, "auto"), (4, "ring"), (4, "auto")])
def test_staged_device_buffers_match_numpy(world, implementation):
    results = _launch.run(world, "staged", implementation, env=STAGING, timeout=120,
                          worker=WORKER)
    text = _describe(results)
    for rc, result, _, _ in results:
        assert rc == 0 and result is not None, text
        assert result["failures"] == [], text
        assert result["cases"] == 42, text
        # DLPack producers are asked for the legacy default stream.
        assert result["streams"] == ["1"], text


@needs_cuda
@pytest.mark.parametrize("world", [1, 2, 4])
def test_nccl_takes_device_buffers(world):
    if _fake_cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} devices; {_fake_cuda.device_count()} visible")
    results = _launch.run(1, "nccl", world, timeout=90, worker=WORKER)
    rc, result, _, stderr = results[0]
    assert rc == 0 and result is not None, stderr
    assert result["failures"] == [] and not any(result["alive"]), result
    for rank in range(world):
        got = result["results"][str(rank)]
        for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
            assert got[name] is True, (rank, name, result)
        assert got["streams"] == [1, 1], result  # a's all-reduce and all-gather
        assert got["host buffer"] == "InvalidArgumentError", result


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_buffers_refused_where_cuda_is_not_usable(world):
    # Without the stand-in on the path: no runtime, or one without a driver or a device.
    env = {"LD_LIBRARY_PATH": "/nonexistent"}
    results = _launch.run(world, "unavailable", env=env, timeout=40, worker=WORKER)
    text = _describe(results)
    for rc, result, _, _ in results:
        assert rc == 0 and result is not None, text
        if "skip" in result:
            pytest.skip(result["skip"])
        first, second = result["errors"]
        assert "buf" in first and "cuda:1" in first and "CUDA is not available" in first, text
        assert "CUDA" in second and "not available" in second, text
        assert result["asked"] is False and result["untouched"] is True, text
        assert result["after"] == [sum(range(1, world + 1))] * 4, text


@needs_cuda
def test_refusals_name_the_argument_and_write_nothing():
    import collectives
    comm = collectives.Communication(collectives.ClusterSpec(), implementation="ring", timeout=10)
    a = _fake_cuda.DeviceArray(6, "float32")
    a.upload(np.arange(6))
    with pytest.raises(collectives.InvalidArgumentError, match="out .*read-only"):
        comm.all_reduce(a, out=a.cai(readonly=True))
    strided = a.cai()
    strided.__cuda_array_interface__.update(shape=(3,), strides=(8,))
    with pytest.raises(collectives.InvalidArgumentError, match="buf .*not C-contiguous"):
        comm.all_reduce(strided)
    with pytest.raises(collectives.InvalidArgumentError, match="stream 0"):
        comm.all_reduce(a.cai(stream=0))
    with pytest.raises(TypeError, match="typestr '<i2'"):
        comm.all_reduce(_fake_cuda.DeviceArray(4, "int16").cai())

    class Liar(_fake_cuda.DeviceArray):  # says CUDA, hands over a CPU tensor
        def __dlpack__(self, stream=None):
            return np.zeros(6, np.float32).__dlpack__()
    with pytest.raises(collectives.InvalidArgumentError, match="said cuda:0"):
        comm.all_reduce(Liar(6, "float32"))
    assert a.download().tolist() == list(range(6))
    # A CUDA buffer beside a host one: the library refuses the pair.
    with pytest.raises(collectives.Error, match="cuda:0|cpu"):
        comm.all_reduce(a, out=np.zeros(6, np.float32))
    comm.all_reduce(a)
    assert a.download().tolist() == list(range(6))
    comm.close()
