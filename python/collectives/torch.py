"""The torch.distributed backend "collectives".

``import collectives.torch`` registers it; then::

    dist.init_process_group("collectives", init_method="env://")   # or tcp://, file://, store=

Every torch.distributed collective of a CPU tensor then runs on this library's communicator
(AUTO by default: shared memory between the ranks of one host, TCP between hosts). Options
(implementation, chunk sizes, ...) come from, in this order: the ``pg_options`` given to
init_process_group or new_group, the options given to :func:`set_options`, the COLLECTIVES_*
environment variables, the library's defaults. See docs/torch.md.
"""

import datetime
import os

import torch  # noqa: F401  (torch.distributed needs torch first)
import torch.distributed as dist

from . import _torch

__all__ = ["Options", "set_options", "get_options", "new_process_group", "ProcessGroupCollectives"]

ProcessGroupCollectives = _torch.ProcessGroupCollectives

# Options field -> (environment variable, parser). listen_address and job_token are read by the
# library itself (COLLECTIVES_LISTEN_ADDRESS, COLLECTIVES_JOB_TOKEN), yield_us too
# (COLLECTIVES_YIELD_US).
_ENVIRONMENT = {
    "implementation": ("COLLECTIVES_IMPLEMENTATION", str),
    "algorithm": ("COLLECTIVES_ALGORITHM", str),
    "chunk_bytes": ("COLLECTIVES_CHUNK_BYTES", int),
    "small_message_bytes": ("COLLECTIVES_SMALL_MESSAGE_BYTES", int),
    "medium_message_bytes": ("COLLECTIVES_MEDIUM_MESSAGE_BYTES", int),
    "bytes_per_pack": ("COLLECTIVES_BYTES_PER_PACK", int),
    "spin_us": ("COLLECTIVES_SPIN_US", int),
    "inline_bytes": ("COLLECTIVES_TORCH_INLINE_BYTES", int),
}
_FIELDS = ("implementation", "inline_bytes", "algorithm", "chunk_bytes", "small_message_bytes",
           "medium_message_bytes", "bytes_per_pack", "spin_us", "yield_us", "job_token",
           "listen_address")


class Options:
    """The communicator's options (CommunicationOptions in include/collectives/communication.h).

    A field left None takes its COLLECTIVES_* environment variable when set, else the library's
    default. implementation: "auto" (default), "ring" or "nccl". chunk_bytes,
    small_message_bytes, medium_message_bytes, algorithm: the ring algorithms' tuning, the same
    on every rank. bytes_per_pack: the fusion bucket of all_reduce_coalesced. spin_us, yield_us:
    how waiters poll. job_token: the job's secret (default: one rank 0 draws and shares through
    torch's store). listen_address: the address the data listener binds to.
    inline_bytes (this backend's own; COLLECTIVES_TORCH_INLINE_BYTES): all_reduce and broadcast
    of at most this many bytes, and barrier when positive, run on the calling thread and return
    completed, even with async_op=True: no hand-off to the communicator's thread. Default 0
    (every call asynchronous). A rank then blocks in such a call until every rank has issued it,
    so a program whose ranks wait for each other between an async call and its wait() through
    something else (another group, the store) must leave it at 0.
    The timeout is init_process_group's (or new_group's) ``timeout``.
    """

    def __init__(self, implementation=None, *, chunk_bytes=None, small_message_bytes=None,
                 medium_message_bytes=None, algorithm=None, bytes_per_pack=None, spin_us=None,
                 yield_us=None, job_token=None, listen_address=None, inline_bytes=None):
        self.implementation = implementation
        self.inline_bytes = inline_bytes
        self.chunk_bytes = chunk_bytes
        self.small_message_bytes = small_message_bytes
        self.medium_message_bytes = medium_message_bytes
        self.algorithm = algorithm
        self.bytes_per_pack = bytes_per_pack
        self.spin_us = spin_us
        self.yield_us = yield_us
        self.job_token = job_token
        self.listen_address = listen_address

    def __repr__(self):
        given = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS
                          if getattr(self, name) is not None and name != "job_token")
        return f"collectives.torch.Options({given})"

    def resolve(self, timeout=None):
        """The library's CommunicationOptions: these fields, else the environment's, else the
        defaults; ``timeout`` (a timedelta or seconds) the communicator's timeout."""
        resolved = _torch.CommunicationOptions()
        for name, value in self._fields().items():
            setattr(resolved, name, value)
        if timeout is not None:
            if not isinstance(timeout, datetime.timedelta):
                timeout = datetime.timedelta(seconds=timeout)
            resolved.timeout = timeout
        return resolved

    def inline(self):
        """inline_bytes, resolved as the other fields (0 by default)."""
        return self._fields(inline=True).get("inline_bytes", 0)

    def _fields(self, inline=False):
        fields = {}
        for name in _FIELDS:
            if (name == "inline_bytes") != inline:
                continue
            value = getattr(self, name)
            if value is None and name in _ENVIRONMENT:
                variable, parse = _ENVIRONMENT[name]
                text = os.environ.get(variable)
                if text:
                    try:
                        value = parse(text)
                    except ValueError:
                        raise ValueError(f"{variable}={text!r} is not a valid {name}") from None
            if value is not None:
                fields[name] = value
        return fields


_default_options = None


def set_options(options=None, **fields):
    """Sets the options of the process groups created after this call without pg_options:
    ``set_options(Options(...))`` or ``set_options(implementation="ring", ...)``; None resets."""
    global _default_options
    if options is not None and fields:
        raise TypeError("set_options takes an Options or keyword fields, not both")
    _default_options = Options(**fields) if fields else options


def get_options():
    """The options set by set_options (an Options; all None by default)."""
    return _default_options if _default_options is not None else Options()


def _master(store):
    """The address and port the listener's route is taken toward: MASTER_ADDR / MASTER_PORT,
    else the host and port of the TCPStore under `store`'s prefixes, else loopback (FileStore,
    HashStore: one host unless COLLECTIVES_LISTEN_ADDRESS says otherwise)."""
    addr = os.environ.get("MASTER_ADDR") or None
    port = os.environ.get("MASTER_PORT") or None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        addr = addr or store.host
        port = port or store.port
    try:
        port = int(port) if port is not None else 0
    except ValueError:
        port = 0
    # The port only has to be non-zero for a multi-rank ClusterSpec: the store is given.
    return addr or "127.0.0.1", port if 0 < port < 65536 else 29500


def new_process_group(store, rank, world_size, timeout=datetime.timedelta(minutes=30),
                      options=None):
    """A ProcessGroupCollectives over `store` (a torch.distributed Store every rank shares), for
    use without init_process_group. Blocks until every rank has connected or `timeout` passed.
    `options` (an Options) wins over set_options field by field."""
    if options is None:
        options = get_options()
    elif not isinstance(options, Options):
        raise TypeError(f"options must be a collectives.torch.Options, not {type(options).__name__}")
    else:
        # Fields the given options leave None come from set_options.
        merged = Options()
        for name in _FIELDS:
            given = getattr(options, name)
            setattr(merged, name, given if given is not None else getattr(get_options(), name))
        options = merged
    addr, port = _master(store)
    return _torch.ProcessGroupCollectives(store, rank, world_size, options.resolve(timeout),
                                          addr, port, options.inline())


def _create(backend_options, pg_options):
    # torch.distributed's creator for the extended API: pg_options is init_process_group's or
    # new_group's pg_options argument.
    return new_process_group(backend_options.store, backend_options.group_rank,
                             backend_options.group_size, backend_options.timeout, pg_options)


if "COLLECTIVES" not in dist.Backend._plugins:
    dist.Backend.register_backend("collectives", _create, extended_api=True)
