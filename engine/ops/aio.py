"""Asynchronous reads and writes between files and CPU tensors: the I/O layer of NVMe offload.

    context = AioContext(AioConfig(block_size=1 << 20, thread_count=2))
    file = open_file(path)                        # a buffered and (where allowed) an O_DIRECT descriptor
    handle = context.write(file, tensor, offset)  # returns at once; `tensor` must not change until waited
    handle.wait()                                 # bytes moved, or AioError / DiskFullError (named below)
    context.read(file, out, offset).wait()
    context.close()                               # waits for what is still in flight

Two back-ends move the bytes, chosen by `AioConfig.backend`: "compiled" is csrc/cpu/aio.cpp (a pool of
C++ threads doing pread/pwrite, reached through the CPU ops library's ctypes binding, which releases
the GIL), "python" a ThreadPoolExecutor doing os.preadv/os.pwritev (which release the GIL too);
"auto" takes the compiled one when builder.load() has it. Both split a transfer the same way (see
[Note: how a transfer is split] in csrc/cpu/aio.cpp): blocks of `block_size` bytes, handed one at a
time to thread_count x queue_depth threads (DeepSpeed's requests in flight), each block through the O_DIRECT
descriptor when its buffer address, file offset and size are multiples of DIRECT_ALIGN (aligned_empty()
gives such buffers) and through the page cache otherwise. liburing and libaio are not used: their
headers are not installed here and the runtime depends on torch, jsonschema, numpy and tqdm only;
benchmarks/bench_aio.py measures both back-ends against dd.

A failed transfer is never partial in silence: wait() raises AioError (path, operation, file offset,
bytes expected and moved, the errno text), DiskFullError for ENOSPC/EFBIG/EDQUOT (with the free space
of the file system), and an end of file inside a read is an AioError too. Sizes of whole files are
checked one layer up (engine/offload/swap_file.py).
"""

from __future__ import annotations

import ctypes
import errno as errno_codes
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from typing_extensions import Self

from engine.ops import builder
from engine.ops.aio_config import BACKENDS, MAX_THREADS, AioConfig

__all__ = [  # the I/O layer in one import: its config (aio_config.py) comes with it
    "BACKENDS",
    "DIRECT_ALIGN",
    "DISK_FULL_ERRNOS",
    "MAX_THREADS",
    "AioConfig",
    "AioContext",
    "AioError",
    "DiskFullError",
    "IOHandle",
    "OpenFile",
    "Outcome",
    "Pending",
    "aligned_empty",
    "free_bytes",
    "open_file",
    "transfer_error",
    "wait_each",
]

DIRECT_ALIGN = 4096
"""Bytes: a block goes through O_DIRECT only when its buffer address, file offset and size are multiples
of this (the largest logical block size of common devices; csrc/cpu/aio.cpp kDirectAlign)."""

DISK_FULL_ERRNOS = frozenset({errno_codes.ENOSPC, errno_codes.EFBIG, errno_codes.EDQUOT})


class AioError(OSError):
    """A read or write that did not move every byte: names the file, operation, offset, bytes expected
    and moved, and the errno text (errno 0: the file ended first)."""

    def __init__(self, op: str, path: str, offset: int, expected: int, got: int, error: int, hint: str = "") -> None:
        self.op, self.path, self.offset, self.expected, self.got = op, path, offset, expected, got
        reason = os.strerror(error) if error else "end of file (the file is shorter than the range)"
        where = "from" if op == "read" else "to"
        super().__init__(
            f"aio {op} of {expected} bytes at offset {offset} {where} {path}: moved {got} bytes ({reason}){hint}"
        )
        self.errno = error


class DiskFullError(AioError):
    """A write refused for space (ENOSPC, EFBIG: the file size limit, EDQUOT): also names the free space."""

    def __init__(self, op: str, path: str, offset: int, expected: int, got: int, error: int) -> None:
        self.free_bytes = free_bytes(path)
        hint = (
            f"; the file system of {path} has {self.free_bytes} bytes free: free space there "
            "or point nvme_path at a larger one"
        )
        super().__init__(op, path, offset, expected, got, error, hint)


def free_bytes(path: str) -> int:
    """Bytes available to this user on the file system holding `path` (or its folder), -1 if unknown."""
    for candidate in (path, os.path.dirname(path) or "."):
        try:
            stat = os.statvfs(candidate)
            return stat.f_bavail * stat.f_frsize
        except OSError:
            continue
    return -1


def transfer_error(op: str, path: str, offset: int, expected: int, got: int, error: int) -> AioError:
    """The named error of a failed transfer (DiskFullError when the disk refused for space)."""
    cls = DiskFullError if error in DISK_FULL_ERRNOS else AioError
    return cls(op, path, offset, expected, got, error)


@dataclass
class OpenFile:
    """A file opened for both back-ends: `fd` through the page cache, `direct_fd` with O_DIRECT (-1 when
    the file system refuses it: every block then goes through `fd`)."""

    path: str
    fd: int
    direct_fd: int

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


def open_file(path: str | os.PathLike[str], create: bool = False) -> OpenFile:
    """Opens `path` for reading and writing (creating it when `create`; FileExistsError if it exists)."""
    flags = os.O_RDWR | os.O_CLOEXEC | ((os.O_CREAT | os.O_EXCL) if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        direct_fd = (
            os.open(path, os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0)) if hasattr(os, "O_DIRECT") else -1
        )
    except OSError as error:
        if error.errno != errno_codes.EINVAL:  # EINVAL: this file system has no O_DIRECT
            os.close(fd)
            raise
        direct_fd = -1
    return OpenFile(os.fspath(path), fd, direct_fd)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a DIRECT_ALIGN boundary (the whole of it moves
    through O_DIRECT when its byte size is a multiple of DIRECT_ALIGN too)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * size + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip : skip + numel * size].view(dtype)


class Outcome(NamedTuple):
    """What a back-end reports of one transfer."""

    bytes: int
    direct_bytes: int
    error: int  # errno of the first failure; 0 with fail_at >= 0: end of file
    fail_at: int  # file offset of the failed block, -1 when none failed
    fail_want: int
    fail_got: int


class Pending(NamedTuple):
    """A back-end's transfer in flight: wait() blocks until it ends (called exactly once), done() says
    whether it has (without blocking)."""

    wait: Callable[[], Outcome]
    done: Callable[[], bool]


class _Backend(Protocol):
    def submit(self, write: bool, file: OpenFile, address: int, nbytes: int, offset: int) -> Pending:
        """Starts a transfer."""
        ...

    def close(self) -> None: ...


class _CompiledPool:
    """csrc/cpu/aio.cpp's thread pool."""

    def __init__(self, lib: ctypes.CDLL, config: AioConfig) -> None:
        self._lib = lib
        # A thread takes one block at a time, so consecutive blocks of a transfer are in flight together,
        # as in one libaio queue.
        self._pool = lib.ze_aio_create(config.threads, config.block_size, 1)
        if not self._pool:
            raise RuntimeError(
                f"aio: could not start {config.threads} I/O threads (aio.thread_count x aio.queue_depth)"
            )

    def submit(self, write: bool, file: OpenFile, address: int, nbytes: int, offset: int) -> Pending:
        ident = self._lib.ze_aio_submit(self._pool, int(write), file.fd, file.direct_fd, address, nbytes, offset)

        def wait() -> Outcome:
            out = (ctypes.c_int64 * 6)()
            if self._lib.ze_aio_wait(self._pool, ident, out) != 0:
                raise RuntimeError(f"aio: transfer {ident} is not pending (waited twice?)")
            return Outcome(*out)

        return Pending(wait, lambda: self._lib.ze_aio_poll(self._pool, ident) != 0)

    def close(self) -> None:
        if self._pool:
            self._lib.ze_aio_destroy(self._pool)
            self._pool = None


class _PythonPool:
    """The fallback: os.preadv/os.pwritev on a ThreadPoolExecutor, split as csrc/cpu/aio.cpp splits."""

    def __init__(self, config: AioConfig) -> None:
        self._config = config
        self._executor = ThreadPoolExecutor(config.threads, thread_name_prefix="zero-engine-aio")

    def submit(self, write: bool, file: OpenFile, address: int, nbytes: int, offset: int) -> Pending:
        block = self._config.block_size
        view = memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B") if nbytes else memoryview(b"")
        # The lowest failed block's start: blocks past it are not started; blocks before it still are, so
        # the bytes moved before a failure do not depend on which thread saw it first.
        failed_from = [nbytes]

        def move(lo: int) -> Outcome:
            """One block (a thread takes one at a time, as the compiled pool's threads do)."""
            if lo > failed_from[0]:
                return Outcome(0, 0, 0, -1, 0, 0)
            size = min(block, nbytes - lo)
            moved, direct, error = _move_block(write, file, view, address, lo, size, offset)
            if error is None:
                return Outcome(moved, direct, 0, -1, 0, 0)
            failed_from[0] = min(failed_from[0], lo)  # two failures racing here at worst let a few more blocks run
            return Outcome(moved, direct, error, offset + lo, size, moved)

        futures: list[Future[Outcome]] = [self._executor.submit(move, lo) for lo in range(0, nbytes, block)]

        def wait() -> Outcome:
            outcomes = [f.result() for f in futures]
            failures = [o for o in outcomes if o.fail_at >= 0]
            first = min(failures, key=lambda o: o.fail_at) if failures else Outcome(0, 0, 0, -1, 0, 0)
            return Outcome(sum(o.bytes for o in outcomes), sum(o.direct_bytes for o in outcomes), *first[2:])

        return Pending(wait, lambda: all(f.done() for f in futures))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _move_block(
    write: bool, file: OpenFile, view: memoryview, address: int, lo: int, size: int, offset: int
) -> tuple[int, int, int | None]:
    """One block, retried on short counts: (bytes moved, of which through O_DIRECT, errno or None;
    0 is the end of the file)."""
    done = direct_done = 0
    direct_ok = file.direct_fd >= 0
    while done < size:
        pos, left = offset + lo + done, size - done
        direct = direct_ok and (address + lo + done) % DIRECT_ALIGN == 0 and pos % DIRECT_ALIGN == 0
        direct = direct and left % DIRECT_ALIGN == 0
        part = view[lo + done : lo + size]
        try:
            fd = file.direct_fd if direct else file.fd
            n = os.pwritev(fd, [part], pos) if write else os.preadv(fd, [part], pos)
        except InterruptedError:
            continue
        except OSError as error:
            if direct and error.errno == errno_codes.EINVAL:  # this request refused by O_DIRECT
                direct_ok = False
                continue
            return done, direct_done, error.errno or errno_codes.EIO
        if n == 0:
            return done, direct_done, 0
        done += n
        direct_done += n if direct else 0
    return done, direct_done, None


class IOHandle:
    """One transfer in flight. wait() returns the bytes moved (all of them) or raises the named error;
    the buffer tensor stays referenced here until then."""

    def __init__(self, op: str, path: str, offset: int, buffer: torch.Tensor, pending: Pending) -> None:
        self.op, self.path, self.offset, self.nbytes = op, path, offset, buffer.numel() * buffer.element_size()
        self._buffer: torch.Tensor | None = buffer
        self._pending = pending
        self._lock = threading.Lock()
        self._outcome: Outcome | None = None
        self.direct_bytes = 0
        """Bytes of this transfer that went through O_DIRECT (set by wait())."""

    def wait(self) -> int:
        with self._lock:
            if self._outcome is None:
                self._outcome = self._pending.wait()
                self._buffer = None
        outcome = self._outcome
        self.direct_bytes = outcome.direct_bytes
        if outcome.fail_at >= 0 or outcome.bytes != self.nbytes:
            raise transfer_error(self.op, self.path, self.offset, self.nbytes, outcome.bytes, outcome.error)
        return outcome.bytes

    @property
    def waited(self) -> bool:
        return self._outcome is not None

    def done(self) -> bool:
        """Whether the transfer has ended (wait() then returns or raises at once)."""
        return self._outcome is not None or self._pending.done()


def _compiled_library() -> ctypes.CDLL | None:
    ops = builder.load()
    return ops.library if ops is not None and hasattr(ops.library, "ze_aio_create") else None


def wait_each(handles: list[IOHandle]) -> AioError | None:
    """Waits for every handle (one waited already raised its error to whoever waited); returns the first
    error, after all are done."""
    first: AioError | None = None
    for handle in handles:
        try:
            handle.wait()
        except AioError as error:
            first = first or error
    return first


class AioContext:
    """Moves bytes between OpenFiles and CPU tensors on the back-end the config picks (see the module
    docstring); handles of every transfer are kept until waited, and close() waits for them all."""

    def __init__(self, config: AioConfig | None = None) -> None:
        self.config = config or AioConfig()
        lib = None if self.config.backend == "python" else _compiled_library()
        if lib is None and self.config.backend == "compiled":
            raise RuntimeError(
                f"aio backend 'compiled' asked for, but the CPU ops library is not built ({builder.status().reason}); "
                "use backend 'auto' or 'python'"
            )
        self.backend = "compiled" if lib is not None else "python"
        self._pool: _Backend | None = _CompiledPool(lib, self.config) if lib is not None else _PythonPool(self.config)
        self._pending: list[IOHandle] = []
        self._lock = threading.Lock()

    def read(self, file: OpenFile, buffer: torch.Tensor, offset: int) -> IOHandle:
        """Starts reading buffer.nbytes bytes at byte `offset` of `file` into `buffer` (a contiguous CPU
        tensor, any dtype); do not touch `buffer` until the handle is waited."""
        return self._submit(False, file, buffer, offset)

    def write(self, file: OpenFile, buffer: torch.Tensor, offset: int) -> IOHandle:
        """Starts writing `buffer`'s bytes at byte `offset` of `file`; do not change `buffer` until waited."""
        return self._submit(True, file, buffer, offset)

    def _submit(self, write: bool, file: OpenFile, buffer: torch.Tensor, offset: int) -> IOHandle:
        op = "write" if write else "read"
        if not isinstance(buffer, torch.Tensor) or not buffer.is_cpu or not buffer.is_contiguous():
            what = type(buffer).__name__ if not isinstance(buffer, torch.Tensor) else f"a tensor on {buffer.device}"
            if isinstance(buffer, torch.Tensor) and buffer.is_cpu:
                what = "a non-contiguous tensor"
            raise ValueError(f"aio {op} of {file.path}: the buffer must be a contiguous CPU tensor, got {what}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"aio {op} of {file.path}: offset must be a non-negative integer, got {offset!r}")
        if file.fd < 0:
            raise ValueError(f"aio {op} of {file.path}: the file is closed")
        nbytes = buffer.numel() * buffer.element_size()
        with self._lock:
            if self._pool is None:
                raise RuntimeError(f"aio {op} of {file.path}: the AioContext is closed")
            self._pending = [h for h in self._pending if not h.waited]
            pending = self._pool.submit(write, file, buffer.data_ptr(), nbytes, offset)
            handle = IOHandle(op, file.path, offset, buffer, pending)
            self._pending.append(handle)
        return handle

    def wait_all(self) -> None:
        """Waits for every transfer not yet waited; raises the first one's error after all are done."""
        with self._lock:
            pending, self._pending = [h for h in self._pending if not h.waited], []
        first = wait_each(pending)
        if first is not None:
            raise first

    def close(self) -> None:
        """Waits for every transfer (raising the first failure) and stops the threads."""
        try:
            self.wait_all()
        finally:
            with self._lock:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.close()

    def __del__(self) -> None:
        # Transfers still in flight write into buffers that only self._pending keeps alive: wait for them
        # before those references go, and say so if one failed (nobody waited to hear it).
        if getattr(self, "_pool", None) is None:
            return
        try:
            self.close()
        except AioError as error:
            warnings.warn(
                f"an AioContext dropped unclosed had a failed transfer: {error}", RuntimeWarning, stacklevel=1
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
