"""collectives: collective communication for data-parallel training.

The numpy module: ClusterSpec, Communication and the packer. `import collectives.torch`
registers the torch.distributed backend "collectives".

    import numpy as np, collectives
    with collectives.Communication() as comm:       # ClusterSpec.from_environment()
        x = np.full(4, comm.rank, np.float32)
        comm.all_reduce(x, "sum")                   # in place, on every rank

Buffers are anything with the buffer protocol (numpy arrays, bytearray, memoryview) or DLPack
(__dlpack__: torch CPU tensors, ...), C-contiguous, of float32, float64, float16, bfloat16
(DLPack, or dtype="bf16" on a 2-byte buffer), int8, uint8, int32 or int64. Every call releases
the GIL; a blocking call on the main thread is interrupted by Ctrl-C (the communicator is
aborted and KeyboardInterrupt raised). See docs/python.md.
"""
import builtins as _builtins
import enum as _enum

from . import _collectives
from ._collectives import ClusterSpec, Communication, Work, build_type, dtype_size, version

__version__ = version()

__all__ = [
    "ClusterSpec", "Communication", "Work", "ErrorCode", "Error", "InvalidArgumentError",
    "InvalidUsageError", "SystemCallError", "PeerLostError", "MismatchError", "TimeoutError",
    "UnauthenticatedError", "AbortedError", "NotSupportedError", "InternalError", "packing",
    "version", "build_type", "dtype_size",
]


class ErrorCode(_enum.IntEnum):
    """The library's closed set of error kinds (collectives::ErrorCode)."""
    INVALID_ARGUMENT = 1
    INVALID_USAGE = 2
    SYSTEM = 3
    PEER_LOST = 4
    MISMATCH = 5
    TIMEOUT = 6
    UNAUTHENTICATED = 7
    ABORTED = 8
    NOT_SUPPORTED = 9
    INTERNAL = 10


class Error(RuntimeError):
    """Every failure the library reports; `.code` is its ErrorCode. The message names, where
    known, the rank, the peer, the collective and its sequence number."""
    code = None


class InvalidArgumentError(Error, ValueError):
    """A bad value from the caller: wrong size, dtype, root, a read-only or strided buffer."""
    code = ErrorCode.INVALID_ARGUMENT


class InvalidUsageError(Error):
    """A call that is not allowed now (on a closed communicator, ...)."""
    code = ErrorCode.INVALID_USAGE


class SystemCallError(Error, OSError):
    """The operating system refused: bind, connect, file I/O."""
    code = ErrorCode.SYSTEM


class PeerLostError(Error, ConnectionError):
    """A peer closed its connection or died."""
    code = ErrorCode.PEER_LOST


class MismatchError(Error):
    """Ranks issued different collectives, sizes, dtypes, ops or roots."""
    code = ErrorCode.MISMATCH


class TimeoutError(Error, _builtins.TimeoutError):  # noqa: A001 (as asyncio.TimeoutError)
    """A deadline passed while waiting for a peer or the rendezvous."""
    code = ErrorCode.TIMEOUT


class UnauthenticatedError(Error, PermissionError):
    """A peer failed the job-token proof."""
    code = ErrorCode.UNAUTHENTICATED


class AbortedError(Error):
    """The communicator was aborted, by this process (abort(), Ctrl-C) or by a peer."""
    code = ErrorCode.ABORTED


class NotSupportedError(Error, NotImplementedError):
    """The build or the machine lacks what the call needs."""
    code = ErrorCode.NOT_SUPPORTED


class InternalError(Error):
    """A bug in the library."""
    code = ErrorCode.INTERNAL


_collectives._set_error_classes({cls.code.value: cls for cls in (
    InvalidArgumentError, InvalidUsageError, SystemCallError, PeerLostError, MismatchError,
    TimeoutError, UnauthenticatedError, AbortedError, NotSupportedError, InternalError)})


def _add_async_forms():
    """comm.all_reduce_async(...) is comm.all_reduce(..., async_op=True): it returns a Work."""
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "reduce",
                 "gather", "scatter", "all_to_all", "send", "recv"):
        blocking = getattr(Communication, name)

        def async_form(self, *args, _blocking=blocking, **kwargs):
            return _blocking(self, *args, async_op=True, **kwargs)

        async_form.__name__ = name + "_async"
        async_form.__qualname__ = "Communication." + name + "_async"
        async_form.__doc__ = f"{name}(..., async_op=True): returns a Work."
        setattr(Communication, name + "_async", async_form)


_add_async_forms()

from . import packing  # noqa: E402  (needs Communication)
