"""The packer: fuses a list of small arrays into a few buckets, so that hundreds of small
gradients cost a few large collectives (include/collectives/packing.h).

    collectives.packing.all_reduce(comm, [w1, w2, b1], "sum")

Every rank passes the same list of (dtype, count) and the same bytes_per_pack; a list that
differs raises MismatchError on every rank with nothing written. The arrays are written in
place: each must be writable and C-contiguous, and no two may share memory.
"""
from . import _collectives

__all__ = ["all_reduce", "broadcast", "all_reduce_async", "broadcast_async", "plan_buckets",
           "default_bytes_per_pack"]


def all_reduce(comm, arrays, op="sum", bytes_per_pack=0, *, async_op=False):
    """All-reduces every array of `arrays` in place, through buckets of at most
    `bytes_per_pack` bytes (0: default_bytes_per_pack()). The result is that of one
    comm.all_reduce per array. Returns the list, or a Work with async_op=True."""
    return comm._packed_all_reduce(list(arrays), op, bytes_per_pack, async_op)


def broadcast(comm, arrays, root=0, bytes_per_pack=0, *, async_op=False):
    """Broadcasts every array of `arrays` in place from `root`, through buckets as above."""
    return comm._packed_broadcast(list(arrays), root, bytes_per_pack, async_op)


def all_reduce_async(comm, arrays, op="sum", bytes_per_pack=0):
    """all_reduce(..., async_op=True): every bucket is issued before it returns a Work; the
    arrays must be left alone until Work.wait() returns."""
    return all_reduce(comm, arrays, op, bytes_per_pack, async_op=True)


def broadcast_async(comm, arrays, root=0, bytes_per_pack=0):
    """broadcast(..., async_op=True)."""
    return broadcast(comm, arrays, root, bytes_per_pack, async_op=True)


def plan_buckets(arrays, bytes_per_pack=0):
    """The buckets all_reduce would use: lists of indices into `arrays`. Each item is an array
    (its dtype and size are read) or a (dtype name, count) pair."""
    specs = []
    for a in arrays:
        if isinstance(a, tuple):
            specs.append((str(a[0]), int(a[1])))
        else:
            specs.append((str(a.dtype), int(a.size)))
    return _collectives._plan_buckets(specs, bytes_per_pack)


def default_bytes_per_pack():
    """The bucket cap that bytes_per_pack=0 picks."""
    return _collectives._default_bytes_per_pack()
