"""Checkpoint hygiene: leftovers of interrupted saves, free space, and I/O errors that name the file."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import torch

from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.safety import owner_is_gone

__all__ = ["check_free_space", "remove_stale", "tensor_bytes", "write_error"]

logger = logging.getLogger("zero.checkpoint")

_MARGIN = 1 << 16
"""Bytes added to a save's estimate (plus 1%: zip and pickle framing, RNG state, the manifest)."""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total


def remove_stale(directory: Path, keep: str = "") -> list[tuple[Path, int]]:
    """Delete leftovers of saves that did not complete; return what was removed and its size.

    Call on one rank (rank 0) after a barrier of the current save or load. ``keep`` is the
    current save's own temporary name. Only entries whose writer is gone are removed (the
    entry's lock names this process or a dead process of this host); each removal is logged
    as a warning with its size.
    """
    removed: list[tuple[Path, int]] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        name = entry.name
        if ".tmp-" not in name or name == keep:
            continue
        if not owner_is_gone(entry):
            logger.info("zero: kept %s: its writer may still be saving (alive, or on another host)", entry)
            continue
        size = _size(entry)
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as exc:
            logger.warning("zero: could not remove %s left by an interrupted checkpoint save: %s", entry, exc)
            continue
        logger.warning(
            "zero: removed %s (%d bytes) left by a checkpoint save that did not complete", entry, size
        )
        removed.append((entry, size))
    return removed


def tensor_bytes(obj: object) -> int:
    """Bytes ``torch.save`` writes for the tensors in a nested dict / list / tuple (each view once)."""
    seen: dict[tuple[int, int], int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            nbytes = item.numel() * item.element_size()
            seen[(item.data_ptr() or id(item), nbytes)] = nbytes
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return sum(seen.values())


def check_free_space(directory: Path, need: int, rank: int, what: str) -> None:
    """Raise :class:`CheckpointError` unless ``directory``'s file system has ``need`` bytes free (+margin)."""
    free = shutil.disk_usage(directory).free
    if free < need + need // 100 + _MARGIN:
        raise CheckpointError(
            f"not enough free space for checkpoint {what}: rank {rank}'s host writes about {need} bytes "
            f"to {directory}, which has {free} bytes free; free some space (e.g. remove old checkpoints) "
            "or save elsewhere. Nothing was written"
        )


def write_error(path: Path, rank: int, exc: BaseException) -> CheckpointError:
    """A :class:`CheckpointError` naming ``path``, ``rank`` and the OS error (ENOSPC: "disk full")."""
    code = exc.errno if isinstance(exc, OSError) else None
    full = code == errno.ENOSPC or code == errno.EDQUOT
    if not full and not isinstance(exc, OSError):
        # torch's zip writer reports a short write as "unexpected pos": ask the file system
        try:
            full = shutil.disk_usage(path.parent).free < _MARGIN
        except OSError:
            full = False
    if full:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else "no space left on device"
        reason = f"disk full (ENOSPC: {detail}; the file system holding {path.parent})"
    elif isinstance(exc, OSError):
        reason = f"{errno.errorcode.get(code or 0, 'OSError')}: {exc.strerror or exc}"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    return CheckpointError(
        f"rank {rank} could not write checkpoint file {path}: {reason}. The previous checkpoint and "
        "'latest' are untouched"
    )
