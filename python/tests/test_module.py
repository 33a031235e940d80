"""The module in one process (a single-rank communicator): buffers and dtypes, the refusals
that write nothing, the exception classes, ClusterSpec, options, lifetime and the packer."""
import datetime
import gc
import os

import numpy as np
import pytest

import collectives


@pytest.fixture
def comm():
    with collectives.Communication(collectives.ClusterSpec(), timeout=10) as c:
        yield c


def test_properties(comm):
    assert (comm.rank, comm.size, comm.implementation) == (0, 1, "auto")
    assert not comm.closed
    assert isinstance(comm.all_reduce_algorithm(8), str)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8,
                                   np.int32, np.int64, np.intc, np.int_, np.longlong])
def test_dtypes_from_the_buffer_format(comm, dtype):
    a = np.arange(6, dtype=dtype).reshape(2, 3)
    assert comm.all_reduce(a, "max") is a
    np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3))


def test_bf16_override_on_a_two_byte_buffer(comm):
    a = np.array([0x3F80, 0x4000], np.uint16)  # bf16 1.0 and 2.0
    comm.all_reduce(a, "sum", dtype="bf16")
    np.testing.assert_array_equal(a, [0x3F80, 0x4000])
    with pytest.raises(collectives.InvalidArgumentError, match="2-byte elements.*bf16|bf16"):
        comm.all_reduce(np.zeros(2, np.float32), dtype="bf16")


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.uint32, np.uint64, np.bool_,
                                   np.complex64])
def test_unknown_dtypes_are_a_type_error_naming_them(comm, dtype):
    a = np.ones(3, dtype)
    with pytest.raises(TypeError, match=np.dtype(dtype).name):
        comm.all_reduce(a)


def test_not_a_buffer(comm):
    with pytest.raises(TypeError, match="neither a buffer"):
        comm.all_reduce([1.0, 2.0])


def test_read_only_and_strided_buffers_are_refused_and_nothing_is_written(comm):
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(collectives.InvalidArgumentError, match="read-only") as e:
        comm.all_reduce(ro)
    assert isinstance(e.value, ValueError) and "rank 0: all_reduce: buf" in str(e.value)
    # A read-only input is fine out of place.
    out = np.zeros(4, np.float32)
    comm.all_reduce(ro, out=out)
    np.testing.assert_array_equal(out, 1)
    strided = np.zeros(8, np.float32)[::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.all_reduce(np.ones(4, np.float32), out=strided)
    assert not strided.any()
    with pytest.raises(collectives.InvalidArgumentError, match="read-only"):
        comm.all_gather(np.ones(1, np.float32), ro)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(bytes(4))


def test_size_and_dtype_mismatches_name_the_collective(comm):
    out = np.full(3, 9, np.float32)
    with pytest.raises(collectives.InvalidArgumentError, match="all_gather"):
        comm.all_gather(np.ones(2, np.float32), out)
    with pytest.raises(collectives.InvalidArgumentError):
        comm.all_reduce(np.ones(3, np.float64), out=out)
    np.testing.assert_array_equal(out, 9)
    with pytest.raises(collectives.InvalidArgumentError, match="reduce op"):
        comm.all_reduce(out, "median")
    with pytest.raises(collectives.InvalidArgumentError):
        comm.broadcast(out, root=1)


def test_error_classes():
    assert issubclass(collectives.Error, RuntimeError)
    assert issubclass(collectives.TimeoutError, TimeoutError)
    assert issubclass(collectives.InvalidArgumentError, ValueError)
    assert issubclass(collectives.PeerLostError, ConnectionError)
    assert issubclass(collectives.NotSupportedError, NotImplementedError)
    for cls in (collectives.MismatchError, collectives.AbortedError, collectives.SystemCallError,
                collectives.UnauthenticatedError, collectives.InvalidUsageError,
                collectives.InternalError):
        assert issubclass(cls, collectives.Error)
        assert isinstance(cls.code, collectives.ErrorCode)


def test_abort_and_close(comm):
    a = np.ones(2, np.float32)
    comm.abort()
    with pytest.raises(collectives.AbortedError) as e:
        comm.all_reduce(a)
    assert e.value.code == collectives.ErrorCode.ABORTED
    comm.close()
    assert comm.closed
    with pytest.raises(collectives.InvalidUsageError, match="closed"):
        comm.barrier()
    comm.close()  # idempotent


def test_context_manager_aborts_on_an_exception():
    with pytest.raises(KeyError):
        with collectives.Communication(collectives.ClusterSpec()) as c:
            raise KeyError("x")
    assert c.closed


def test_timeouts():
    spec = collectives.ClusterSpec()
    collectives.Communication(spec, timeout=datetime.timedelta(seconds=2)).close()
    c = collectives.Communication(spec, timeout=1.5)
    c.set_timeout(3)
    c.set_timeout(datetime.timedelta(milliseconds=10))
    with pytest.raises(ValueError, match="positive"):
        c.set_timeout(0)
    with pytest.raises(TypeError):
        c.set_timeout("1s")
    c.close()
    with pytest.raises(collectives.InvalidArgumentError, match="positive"):
        collectives.Communication(spec, timeout=-1)
    with pytest.raises(collectives.InvalidArgumentError):
        collectives.Communication(spec, implementation="carrier-pigeon")


def test_async_work_holds_its_buffers(comm):
    w = comm.all_reduce_async(np.full(1000, 3, np.int32), "sum")
    gc.collect()
    out = w.wait()
    assert w.done() and w.is_completed()
    np.testing.assert_array_equal(out, 3)
    assert comm.barrier(async_op=True).wait() is None


def test_dlpack_producers(comm):
    class Producer:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    a = np.arange(5, dtype=np.float32)
    comm.all_reduce(Producer(a), "sum")
    np.testing.assert_array_equal(a, np.arange(5))

    class OnGpu(Producer):
        def __dlpack_device__(self):
            return (2, 0)

    # Where CUDA is usable the tensor contradicts its device; elsewhere CUDA is refused first.
    with pytest.raises((collectives.InvalidArgumentError, collectives.NotSupportedError),
                       match="cuda:0"):
        comm.all_reduce(OnGpu(a))


def test_torch_tensors_through_dlpack(comm):
    torch = pytest.importorskip("torch")
    t = torch.arange(4, dtype=torch.bfloat16)
    comm.all_reduce(t, "sum")
    assert t.tolist() == [0, 1, 2, 3]
    # The bf16 dtype comes from DLPack: an f32 output is a dtype mismatch.
    with pytest.raises(collectives.InvalidArgumentError, match="bf16"):
        comm.all_reduce(t, out=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.all_reduce(torch.zeros(4, 4)[:, 0])


def test_cluster_spec():
    s = collectives.ClusterSpec(rank=1, world_size=2, master_port=29500, job_token="secret")
    assert (s.rank, s.world_size, s.master_addr, s.master_port) == (1, 2, "127.0.0.1", 29500)
    assert "secret" not in repr(s)
    s.validate()
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_PORT": "1234"}
    s = collectives.ClusterSpec.from_environment(env)
    assert (s.rank, s.world_size, s.master_port) == (1, 4, 1234)
    with pytest.raises(collectives.InvalidArgumentError, match="MASTER_PORT"):
        collectives.ClusterSpec.from_environment({"RANK": "0", "WORLD_SIZE": "2"})
    assert collectives.ClusterSpec.from_environment({}).world_size == 1


def test_packing(comm):
    arrays = [np.ones(3, np.float32), np.zeros(0, np.float32), np.full(5, 2.0)]
    assert collectives.packing.all_reduce(comm, arrays, "sum", bytes_per_pack=8) is not None
    np.testing.assert_array_equal(arrays[2], 2.0)
    w = collectives.packing.all_reduce_async(comm, arrays)
    w.wait()
    assert collectives.packing.plan_buckets(arrays, 1 << 20) == [[0, 1], [2]]
    assert collectives.packing.plan_buckets([("f32", 4), ("f32", 4)], 16) == [[0], [1]]
    assert collectives.packing.default_bytes_per_pack() == 1 << 20
    ro = np.ones(2)
    ro.flags.writeable = False
    with pytest.raises(collectives.InvalidArgumentError, match="tensor 1"):
        collectives.packing.all_reduce(comm, [np.ones(2), ro])


def test_rooted_collectives_need_their_root_buffers(comm):
    a = np.arange(3, dtype=np.float32)
    with pytest.raises(collectives.InvalidArgumentError, match="gather: recv is required"):
        comm.gather(a, None, 0)
    with pytest.raises(collectives.InvalidArgumentError, match="scatter: send is required"):
        comm.scatter(None, a, 0)
    np.testing.assert_array_equal(comm.reduce(a, None, "max", 0), [0, 1, 2])  # in place
    out = np.zeros(3, np.float32)
    assert comm.gather(a, out, 0) is out
    np.testing.assert_array_equal(out, a)
    with pytest.raises(collectives.InvalidArgumentError):
        comm.reduce(a, None, "sum", 1)
    with pytest.raises(collectives.InvalidArgumentError):
        comm.all_to_all(a, np.zeros(3, np.float32), [3, 0], [3])


def test_a_dropped_work_and_calls_from_threads(comm):
    import threading
    comm.all_reduce_async(np.ones(100, np.float32))  # dropped at once: waits, then frees
    results = []

    def worker():
        a = np.full(10, 2, np.int64)
        comm.all_reduce(a, "prod")
        results.append(a.tolist())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[2] * 10] * 4
