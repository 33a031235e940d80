"""CUDA memory for the tests from the CUDA runtime that the library loads (on a machine without a
GPU, the CPU stand-in tests/nccl/fake/fake_cuda_nccl.cc under the name libcudart.so.13), through
ctypes: device buffers, pinned host buffers and streams, shown to the module as DLPack producers
(__dlpack__, __dlpack_device__) and as CUDA arrays (__cuda_array_interface__), as CuPy, Numba and
PyTorch show theirs."""
import ctypes

import numpy as np

KDL_CUDA, KDL_CUDA_HOST = 2, 3
_H2D, _D2H = 1, 2
_NON_BLOCKING = 1

_cudart = None


def runtime():
    """The CUDA runtime (libcudart.so.13 on the dynamic linker's path), or None."""
    global _cudart
    if _cudart is None:
        try:
            lib = ctypes.CDLL("libcudart.so.13")
        except OSError:
            return None
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                      ctypes.c_uint]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaDeviceSynchronize.argtypes = []
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        _cudart = lib
    return _cudart


def usable_runtime():
    """Whether a CUDA runtime that the library would load (libcudart.so.13, .12 or libcudart.so)
    sees a device."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        return lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0
    return False


def device_count():
    """The devices the runtime on the path (runtime()) sees; 0 without one."""
    lib = runtime()
    count = ctypes.c_int(0)
    if lib is None or lib.cudaGetDeviceCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed: cudaError {status}")


def set_device(device):
    _check(runtime().cudaSetDevice(device), "cudaSetDevice")


def stream():
    s = ctypes.c_void_p()
    _check(runtime().cudaStreamCreateWithFlags(ctypes.byref(s), _NON_BLOCKING), "cudaStreamCreate")
    return s.value


def pinned(nbytes):
    """Pinned host memory as a numpy uint8 array (kept until the process ends)."""
    p = ctypes.c_void_p()
    _check(runtime().cudaHostAlloc(ctypes.byref(p), max(nbytes, 1), 0), "cudaHostAlloc")
    return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(p.value))[:nbytes]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_CAPSULE_NAME = ctypes.c_char_p(b"dltensor")
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_DL_CODES = {"f": 2, "i": 0, "u": 1}


class DeviceArray:
    """`count` elements of numpy dtype `dtype` in memory of CUDA device `device` (or, with
    pinned=True, pinned host memory, kDLCUDAHost). As a DLPack producer it records the stream
    each __dlpack__ call asks for (`streams`); `cai()` gives a __cuda_array_interface__ view."""

    def __init__(self, count, dtype, device=0, pinned_memory=False):
        self.count, self.dtype, self.device = count, np.dtype(dtype), device
        self.nbytes = count * self.dtype.itemsize
        self.pinned = pinned_memory
        self.streams = []
        self._capsules = []  # the DLManagedTensors handed out, alive as long as this array
        p = ctypes.c_void_p()
        set_device(device)
        if pinned_memory:
            _check(runtime().cudaHostAlloc(ctypes.byref(p), max(self.nbytes, 1), 0),
                   "cudaHostAlloc")
        else:
            _check(runtime().cudaMalloc(ctypes.byref(p), max(self.nbytes, 1)), "cudaMalloc")
        self.ptr = p.value

    def upload(self, array):
        a = np.ascontiguousarray(array, dtype=self.dtype)
        assert a.size == self.count
        if self.pinned:
            ctypes.memmove(self.ptr, a.ctypes.data, self.nbytes)
            return
        _check(runtime().cudaMemcpy(self.ptr, a.ctypes.data, self.nbytes, _H2D), "cudaMemcpy")

    def download(self):
        a = np.empty(self.count, self.dtype)
        if self.pinned:
            ctypes.memmove(a.ctypes.data, self.ptr, self.nbytes)
            return a
        _check(runtime().cudaMemcpy(a.ctypes.data, self.ptr, self.nbytes, _D2H), "cudaMemcpy")
        return a

    def __dlpack_device__(self):
        return (KDL_CUDA_HOST if self.pinned else KDL_CUDA, self.device)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        shape = (ctypes.c_int64 * 1)(self.count)
        m = _DLManagedTensor()
        m.dl_tensor.data = self.ptr
        m.dl_tensor.device = _DLDevice(*self.__dlpack_device__())
        m.dl_tensor.ndim = 1
        m.dl_tensor.dtype = _DLDataType(_DL_CODES[self.dtype.kind], self.dtype.itemsize * 8, 1)
        m.dl_tensor.shape = shape
        m.dl_tensor.strides = None
        m.dl_tensor.byte_offset = 0
        self._capsules.append((m, shape))
        return _PyCapsule_New(ctypes.addressof(m), _CAPSULE_NAME, None)

    def cai(self, stream=None, readonly=False):
        return CudaArray(self, stream, readonly)


class CudaArray:
    """A __cuda_array_interface__ (version 3) view of a DeviceArray, with its "stream"."""

    def __init__(self, array, stream, readonly):
        self.array = array
        self.__cuda_array_interface__ = {
            "shape": (array.count,), "typestr": array.dtype.str, "data": (array.ptr, readonly),
            "version": 3, "strides": None, "stream": stream}


class FakeCudaTensor:
    """A DLPack producer that says it lives on cuda:`device` and fails if asked for its tensor:
    for machines where CUDA is not usable, whose refusal must come first."""

    def __init__(self, device=0):
        self.device = device
        self.asked = False

    def __dlpack_device__(self):
        return (KDL_CUDA, self.device)

    def __dlpack__(self, stream=None):
        self.asked = True
        raise AssertionError("__dlpack__ called where CUDA is not usable")
