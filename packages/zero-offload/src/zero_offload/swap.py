"""Asynchronous swap files: tensors written to and read back from a directory (e.g. on NVMe).

:class:`AsyncSwapper` owns one directory. :meth:`AsyncSwapper.write` and
:meth:`AsyncSwapper.read` queue a request on a thread pool and return a :class:`SwapHandle`
at once; :meth:`SwapHandle.wait` blocks until the bytes are on disk (or in the tensor) and
re-raises any error. The system calls (``os.pwritev`` / ``os.preadv``) and the checksum
(:func:`payload_checksum`, torch reductions) release the GIL, so swapping overlaps computation.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import enum
import errno
import os
import re
import shutil
import struct
import threading
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from zero_comm.closing import ClosesOnExit
from zero_comm.units import format_bytes
from zero_offload.pool import ALIGNMENT, align_up, aligned_empty
from zero_offload.transfers import Transfers

__all__ = [
    "AsyncSwapper",
    "IoMode",
    "SwapError",
    "SwapHandle",
    "SwapSpaceError",
    "SwapStats",
    "detect_io_mode",
    "payload_checksum",
]

SUFFIX = ".zswap"
"""File name suffix of swap files (files with it in a swapper's directory are its own)."""

HEADER_BYTES = ALIGNMENT
_MAGIC = b"ZEROSWP2"
_HEAD = struct.Struct("<8sQQQQ16sH")  # magic, numel, nbytes, payload checksum (2 x u64), dtype, id length
_ROW = 512
"""64-bit words per row of the payload checksum (4 KiB)."""
_PROBE = ".zero_direct_io_probe"


class SwapError(RuntimeError):
    """A swap file is missing, truncated, corrupt or another tensor's; or the directory is unusable."""


class SwapSpaceError(SwapError):
    """The swap directory's filesystem has less free space than the swapper needs."""


class IoMode(enum.Enum):
    """How swap files are read and written."""

    DIRECT = "direct"
    """``O_DIRECT``: bypasses the page cache; aligned addresses, lengths and offsets."""
    BUFFERED = "buffered"
    """Plain ``pread`` / ``pwrite`` through the page cache."""


@dataclasses.dataclass
class SwapStats:
    """Counters of completed requests (updated by the I/O threads under a lock)."""

    writes: Transfers = dataclasses.field(default_factory=Transfers)
    reads: Transfers = dataclasses.field(default_factory=Transfers)
    bounced_bytes: int = 0


class SwapHandle:
    """One queued read or write; :meth:`wait` blocks until it is done."""

    __slots__ = ("_future", "path", "tensor_id")

    def __init__(self, future: concurrent.futures.Future[None], tensor_id: str, path: Path) -> None:
        self._future = future
        self.tensor_id = tensor_id
        self.path = path

    def done(self) -> bool:
        """Whether the request has finished (successfully or not)."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[object], None]) -> None:
        """Call ``fn(future)`` in an I/O thread (or now) once the request has finished."""
        self._future.add_done_callback(fn)

    def wait(self) -> None:
        """Block until the request is done; re-raise its error (a :class:`SwapError` or ``OSError``)."""
        self._future.result()


def detect_io_mode(directory: Path) -> IoMode:
    """:attr:`IoMode.DIRECT` if ``directory``'s filesystem accepts an aligned ``O_DIRECT`` write and read."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return IoMode.BUFFERED
    probe = directory / _PROBE
    block = aligned_empty(ALIGNMENT)
    block.fill_(7)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            view = _bytes(block)
            ok = os.pwritev(fd, [view], 0) == ALIGNMENT and os.preadv(fd, [view], 0) == ALIGNMENT
        finally:
            os.close(fd)
    except OSError:
        ok = False
    finally:
        probe.unlink(missing_ok=True)
    return IoMode.DIRECT if ok else IoMode.BUFFERED


class _Files:
    """The swapper's files (shared with its finalizer, which must not reference the swapper)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.paths: dict[str, Path] = {}
        self.lock = threading.Lock()

    def path_for(self, tensor_id: str) -> Path:
        with self.lock:
            path = self.paths.get(tensor_id)
            if path is None:
                safe = re.sub(r"[^A-Za-z0-9._-]", "_", tensor_id)[:80]
                path = self.directory / f"{len(self.paths):06d}-{safe}{SUFFIX}"
                self.paths[tensor_id] = path
            return path

    def known(self, tensor_id: str) -> Path | None:
        with self.lock:
            return self.paths.get(tensor_id)

    def remove_all(self) -> None:
        with self.lock:
            for path in self.paths.values():
                path.unlink(missing_ok=True)
            self.paths.clear()


def _shutdown(files: _Files, executor: concurrent.futures.ThreadPoolExecutor) -> None:
    executor.shutdown(wait=True)
    files.remove_all()


class AsyncSwapper(ClosesOnExit):
    """Tensors swapped to files in one directory through a pool of I/O threads."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        required_bytes: int = 0,
        tensor_count: int = 0,
        io_threads: int = 2,
        io_mode: IoMode | None = None,
        free_bytes: Callable[[Path], int] | None = None,
    ) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f"{_PROBE}.w"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as exc:
            raise SwapError(
                f"swap directory {self.directory} is not usable ({exc}); "
                "point nvme_path at a writable directory"
            ) from exc
        for stale in self.directory.glob(f"*{SUFFIX}"):
            stale.unlink(missing_ok=True)
        needed = required_bytes + tensor_count * (HEADER_BYTES + ALIGNMENT)
        free = (free_bytes or _free_bytes)(self.directory)
        if needed > free:
            raise SwapSpaceError(
                f"swap directory {self.directory} has {format_bytes(free, binary=True)} free, but "
                "swapping needs "
                f"{format_bytes(needed, binary=True)} ({needed} bytes); free space there or point nvme_path "
                "at a larger filesystem"
            )
        self.io_mode = io_mode if io_mode is not None else detect_io_mode(self.directory)
        self.stats = SwapStats()
        self._stats_lock = threading.Lock()
        self._files = _Files(self.directory)
        self._executor = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="zero-swap")
        self._finalizer = weakref.finalize(self, _shutdown, self._files, self._executor)

    # ------------------------------------------------------------------ public API

    def write(self, tensor_id: str, tensor: torch.Tensor) -> SwapHandle:
        """Queue writing ``tensor`` (contiguous, CPU) as the swap file of ``tensor_id``.

        Do not modify ``tensor`` before the handle's :meth:`SwapHandle.wait` returns.
        """
        _check_tensor(tensor, "write")
        path = self._files.path_for(tensor_id)
        future = self._executor.submit(self._write, tensor_id, tensor, path)
        return SwapHandle(future, tensor_id, path)

    def read(self, tensor_id: str, out: torch.Tensor) -> SwapHandle:
        """Queue reading the swap file of ``tensor_id`` into ``out`` (contiguous, CPU, same numel and dtype).

        The handle's :meth:`SwapHandle.wait` raises :class:`SwapError` if the file is missing,
        truncated, written for another tensor, numel or dtype, or fails its checksum.
        """
        _check_tensor(out, "read")
        path = self._files.known(tensor_id)
        if path is None:
            raise SwapError(f"no swap file was written for tensor {tensor_id!r} in {self.directory}")
        future = self._executor.submit(self._read, tensor_id, out, path)
        return SwapHandle(future, tensor_id, path)

    def path_of(self, tensor_id: str) -> Path | None:
        """The swap file of ``tensor_id`` (``None`` if it was never written)."""
        return self._files.known(tensor_id)

    def close(self) -> None:
        """Finish queued requests and delete every swap file (idempotent)."""
        self._finalizer()

    # ------------------------------------------------------------------ I/O threads

    def _flags(self) -> int:
        return os.O_DIRECT if self.io_mode is IoMode.DIRECT else 0

    def _write(self, tensor_id: str, tensor: torch.Tensor, path: Path) -> None:
        payload = _bytes(tensor)
        nbytes = payload.nbytes
        header = _encode_header(tensor_id, tensor, payload_checksum(tensor))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o600)
        try:
            if self.io_mode is IoMode.BUFFERED:
                _pwrite_all(fd, memoryview(header.ljust(HEADER_BYTES, b"\0")), 0, path)
                _pwrite_all(fd, payload, HEADER_BYTES, path)
            else:
                block = aligned_empty(HEADER_BYTES)
                block.zero_()
                _bytes(block)[: len(header)] = header
                _pwrite_all(fd, _bytes(block), 0, path)
                self._direct_payload(fd, tensor, nbytes, path, write=True)
        finally:
            os.close(fd)
        with self._stats_lock:
            self.stats.writes.add(nbytes)

    def _read(self, tensor_id: str, out: torch.Tensor, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | self._flags())
        except FileNotFoundError:
            raise SwapError(f"swap file {path} of tensor {tensor_id!r} is missing") from None
        try:
            size = os.fstat(fd).st_size
            nbytes = out.numel() * out.element_size()
            block = aligned_empty(HEADER_BYTES)
            if size >= HEADER_BYTES:
                _pread_all(fd, _bytes(block), 0, path, tensor_id)
                crc = _decode_header(bytes(_bytes(block)), tensor_id, out, path)
            if size < HEADER_BYTES + nbytes:
                raise SwapError(
                    f"swap file {path} of tensor {tensor_id!r} is truncated: {size} bytes, "
                    f"expected at least {HEADER_BYTES + nbytes}"
                )
            if self.io_mode is IoMode.BUFFERED:
                _pread_all(fd, _bytes(out), HEADER_BYTES, path, tensor_id)
            else:
                self._direct_payload(fd, out, nbytes, path, write=False, tensor_id=tensor_id)
        finally:
            os.close(fd)
        if payload_checksum(out) != crc:
            raise SwapError(f"swap file {path} of tensor {tensor_id!r} is corrupt: payload checksum mismatch")
        with self._stats_lock:
            self.stats.reads.add(nbytes)

    def _direct_payload(
        self, fd: int, tensor: torch.Tensor, nbytes: int, path: Path, *, write: bool, tensor_id: str = ""
    ) -> None:
        """Move the payload with O_DIRECT: aligned part in place, tail (or all) through a bounce buffer."""
        data = _bytes(tensor)
        aligned_start = tensor.data_ptr() % ALIGNMENT == 0
        direct = (nbytes // ALIGNMENT) * ALIGNMENT if aligned_start else 0
        if direct:
            if write:
                _pwrite_all(fd, data[:direct], HEADER_BYTES, path)
            else:
                _pread_all(fd, data[:direct], HEADER_BYTES, path, tensor_id)
        rest = nbytes - direct
        if rest == 0:
            return
        bounce = aligned_empty(align_up(rest))
        view = _bytes(bounce)
        if write:
            bounce.zero_()
            view[:rest] = data[direct:]
            _pwrite_all(fd, view, HEADER_BYTES + direct, path)
        else:
            _pread_all(fd, view, HEADER_BYTES + direct, path, tensor_id, need=rest)
            data[direct:] = view[:rest]
        if not aligned_start:
            with self._stats_lock:
                self.stats.bounced_bytes += nbytes


# ---------------------------------------------------------------------- helpers


def _free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"swap {what} needs a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}"
        )


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of contiguous ``t``'s memory (keep ``t`` alive while it is used)."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def payload_checksum(t: torch.Tensor) -> tuple[int, int]:
    """A Fletcher-style checksum of ``t``'s bytes: ``(sum, position-weighted sum)`` modulo 2**64."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    n8 = flat.numel() // 8 * 8
    head = flat[:n8]
    if head.data_ptr() % 8:
        head = head.clone()
    words = head.view(torch.int64)
    rows = words.numel() // _ROW
    parts = torch.cat(
        [
            words[: rows * _ROW].view(rows, _ROW).sum(1),
            words[rows * _ROW :],
            flat[n8:].to(torch.int64),
        ]
    )
    weights = torch.arange(1, 2 * parts.numel() + 1, 2, dtype=torch.int64)
    return int(parts.sum()) & _MASK, int((parts * weights).sum()) & _MASK


_MASK = (1 << 64) - 1


def _encode_header(tensor_id: str, tensor: torch.Tensor, check: tuple[int, int]) -> bytes:
    name = tensor_id.encode()
    dtype = str(tensor.dtype).removeprefix("torch.").encode()
    nbytes = tensor.numel() * tensor.element_size()
    body = _HEAD.pack(_MAGIC, tensor.numel(), nbytes, check[0], check[1], dtype, len(name)) + name
    if len(body) + 4 > HEADER_BYTES:
        raise ValueError(f"tensor id {tensor_id[:60]!r}... is too long for a swap header ({len(name)} bytes)")
    return body + struct.pack("<I", zlib.crc32(body))


def _decode_header(block: bytes, tensor_id: str, out: torch.Tensor, path: Path) -> tuple[int, int]:
    magic, numel, nbytes, check0, check1, dtype, id_len = _HEAD.unpack_from(block)
    where = f"swap file {path} of tensor {tensor_id!r}"
    if magic != _MAGIC:
        raise SwapError(f"{where} is corrupt: not a zero swap file (bad magic {magic!r})")
    end = _HEAD.size + id_len
    if end + 4 > HEADER_BYTES or struct.unpack_from("<I", block, end)[0] != zlib.crc32(block[:end]):
        raise SwapError(f"{where} is corrupt: header checksum mismatch")
    saved_id = block[_HEAD.size : end].decode(errors="replace")
    want_dtype = str(out.dtype).removeprefix("torch.")
    saved_dtype = dtype.rstrip(b"\0").decode(errors="replace")
    if saved_id != tensor_id or numel != out.numel() or saved_dtype != want_dtype:
        raise SwapError(
            f"{where} holds tensor {saved_id!r} ({numel} x {saved_dtype}), expected "
            f"{tensor_id!r} ({out.numel()} x {want_dtype})"
        )
    del nbytes
    return int(check0), int(check1)


def _pwrite_all(fd: int, data: memoryview, offset: int, path: Path) -> None:
    view = data
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write to swap file {path}")
        done += n


def _pread_all(
    fd: int,
    data: memoryview,
    offset: int,
    path: Path,
    tensor_id: str,
    need: int | None = None,
) -> None:
    view = data
    need = len(view) if need is None else need
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise SwapError(
                f"swap file {path} of tensor {tensor_id!r} is truncated (read {done} of {need} bytes)"
            )
        done += n
