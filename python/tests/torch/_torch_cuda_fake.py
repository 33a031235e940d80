"""CUDA tensors for the torch backend's tests with a torch built without CUDA: torch tensors on
cuda:N over the device memory of the CUDA runtime on the dynamic linker's path (on a machine
without a GPU, the CPU stand-in tests/nccl/fake/fake_cuda_nccl.cc), made by the backend's
test-only _cuda_tensor_for_tests. Torch's own kernels cannot run on them: inputs are uploaded and
results downloaded with cudaMemcpy (python/tests/_fake_cuda.py) and checked against numpy."""
import ctypes
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _fake_cuda as fc  # noqa: E402  (python/tests)
from collectives import _torch  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
                "int64": torch.int64}


def inputs(rank, count, dtype, case):
    """Rank `rank`'s input of case `case`: small integers, exact in every dtype."""
    return ((np.arange(count) * 7 + rank * 13 + case) % 23 - 11).astype(dtype)


class Buffer:
    """`count` elements of `dtype` in device memory of cuda:`device`, as numpy sees it (upload,
    download) and as torch does (tensor(), or parts(n): n tensors back to back over it)."""

    def __init__(self, count, dtype, device):
        self.array = fc.DeviceArray(count, dtype, device)
        self.count, self.dtype, self.device = count, np.dtype(dtype), device

    def upload(self, values):
        self.array.upload(values)
        return self

    def download(self):
        return self.array.download()

    def tensor(self, offset=0, count=None):
        count = self.count - offset if count is None else count
        return _torch._cuda_tensor_for_tests(self.array.ptr + offset * self.dtype.itemsize,
                                             [count], TORCH_DTYPES[self.dtype.name], self.device)

    def parts(self, n):
        size = self.count // n
        return [self.tensor(i * size, size) for i in range(n)]


def copy_stats():
    """The stand-in's host<->device copy counters (bytes, largest, copies, ...), or None where
    the runtime is not the stand-in."""
    try:
        fn = fc.runtime().collectivesFakeCudaCopyStats
    except AttributeError:
        return None
    stats = (ctypes.c_uint64 * 6)()
    fn(stats)
    return list(stats)


def reset_copy_stats():
    try:
        fc.runtime().collectivesFakeCudaResetCopyStats()
    except AttributeError:
        pass
