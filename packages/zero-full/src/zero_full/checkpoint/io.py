"""Files of a sharded checkpoint: manifest, shard files, hashes, atomic writes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "BUFFERS_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST",
    "READABLE_VERSIONS",
    "MANIFEST",
    "ListedFile",
    "CheckpointError",
    "dtype_from_name",
    "dtype_name",
    "file_digest",
    "fsync_dir",
    "open_shard",
    "shard_file_name",
    "verify_file",
    "write_text_atomic",
    "write_torch",
]

FORMAT_NAME = "zero-checkpoint"
FORMAT_VERSION = 2
"""Version 2 adds ``manifest_sha256`` (the manifest's own digest); version 1 is still read."""
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
LATEST = "latest"
BUFFERS_FILE = "buffers.pt"
_HASH_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (the message names the file or parameter)."""


def shard_file_name(rank: int) -> str:
    """The shard file of ``rank``."""
    return f"rank{rank:05d}.pt"


def file_digest(path: Path) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a file, read in chunks (constant memory)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class ListedFile(Protocol):
    """What the manifest records of a file (``manifest.FileEntry``): its size and sha256."""

    @property
    def size(self) -> int: ...

    @property
    def sha256(self) -> str: ...


def verify_file(path: Path, entry: ListedFile) -> None:
    """Check a file's size and sha256 against its manifest entry.

    Raises:
        CheckpointError: the file is missing, truncated or corrupt (names the file).
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (listed in the manifest)")
    size, digest = file_digest(path)
    if size != entry.size:
        raise CheckpointError(
            f"checkpoint file {path} is {size} bytes, the manifest says {entry.size}: truncated or "
            "replaced; re-save the checkpoint or use another tag"
        )
    if digest != entry.sha256:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt: sha256 {digest} differs from the manifest's "
            f"{entry.sha256}; re-save the checkpoint or use another tag"
        )


def write_torch(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` and flush it to disk."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def open_shard(path: Path) -> dict[str, Any]:
    """Load a shard file memory-mapped: tensors are read from disk only where they are sliced.

    Raises:
        CheckpointError: the file cannot be read (a pickle ``weights_only`` refuses — nothing in
            it runs —, a truncated or foreign file), naming it.
    """
    try:
        shard = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling, zip and OS errors alike: name the file
        raise CheckpointError(
            f"checkpoint file {path} cannot be read ({type(exc).__name__}: {str(exc)[:300]}); it is "
            "corrupt or not a zero checkpoint file (nothing in it was run: files are read with "
            "weights_only). Re-save the checkpoint or use another tag"
        ) from exc
    if not isinstance(shard, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(shard).__name__}, not a zero shard")
    return shard


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (never half written)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (renames) to disk where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``.

    Raises:
        CheckpointError: not a torch dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint manifest")
    return dtype
