"""What a checkpoint may name, and whose leftovers may be removed."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

from zero_full.checkpoint.io import LATEST, MANIFEST, CheckpointError
from zero_launch import pid_alive

__all__ = [
    "WRITER_FILE",
    "WriterLock",
    "inside",
    "owner_is_gone",
    "resolve_tag",
    "validate_tag",
]

WRITER_FILE = ".writer"


def validate_tag(tag: object, where: str = "checkpoint tag") -> str:
    """Return ``tag`` if it is one plain directory name, else raise naming it.

    Raises:
        CheckpointError: not a string, empty, surrounded by spaces, a path (``/``, ``\\``,
            ``.``, ``..``), ``latest``, a temporary name (``.tmp-``) or holding a control character.
    """
    if not isinstance(tag, str):
        raise CheckpointError(f"{where} {tag!r} is not a string")
    problem = ""
    if tag in ("", ".", "..", LATEST):
        problem = "a reserved name"
    elif tag != tag.strip():
        problem = "surrounded by spaces"
    elif "/" in tag or "\\" in tag or os.sep in tag:
        problem = "a path, not a directory name"
    elif ".tmp-" in tag or tag.startswith("."):
        problem = "a temporary or hidden name"
    elif any(ord(c) < 32 for c in tag):
        problem = "holding a control character"
    if problem:
        raise CheckpointError(f"{where} {tag!r} is {problem}; use a plain directory name such as 'step100'")
    return tag


def inside(root: Path, name: str, what: str) -> Path:
    """``root / name`` if it resolves inside ``root`` (symlinks followed), else raise.

    Raises:
        CheckpointError: ``name`` is absolute or leads out of ``root`` (``..``, a symlink).
    """
    base = root.resolve()
    target = (root / name).resolve()
    if os.path.isabs(name) or (target != base and base not in target.parents):
        raise CheckpointError(
            f"{what} names {name!r}, which resolves to {target}, outside the checkpoint root {base}: "
            "refused (a checkpoint only names files inside its own directory)"
        )
    return root / name


def resolve_tag(directory: Path, tag: str | None) -> str:
    """The tag to load: ``tag`` itself, or the content of ``directory/latest`` when ``None``.

    Either must be a plain directory name (:func:`validate_tag`) inside ``directory``.

    Raises:
        CheckpointError: no ``latest`` file, an invalid tag, or the tag directory does not exist.
    """
    if tag is None:
        latest = directory / LATEST
        if not latest.is_file():
            raise CheckpointError(
                f"no checkpoint to load in {directory}: {latest} does not exist; pass tag=... "
                "or save a checkpoint first"
            )
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{latest} cannot be read: {exc}") from None
        validate_tag(tag, f"{latest} names the tag")
    else:
        validate_tag(tag)
    inside(directory, tag, f"checkpoint tag {tag!r}")
    if not (directory / tag).is_dir():
        found = (
            sorted(p.name for p in directory.iterdir() if (p / MANIFEST).is_file())
            if directory.is_dir()
            else []
        )
        raise CheckpointError(
            f"checkpoint tag {tag!r} not found in {directory} (complete tags there: {found or 'none'})"
        )
    return tag


@dataclasses.dataclass(frozen=True)
class WriterLock:
    """Who writes a temporary checkpoint directory: ``pid`` on ``host``."""

    pid: int
    host: str

    @classmethod
    def mine(cls) -> WriterLock:
        """This process."""
        return cls(os.getpid(), socket.gethostname())

    def write(self, directory: Path) -> None:
        """Write ``directory/.writer``."""
        (directory / WRITER_FILE).write_text(json.dumps({"pid": self.pid, "host": self.host}))

    @classmethod
    def read(cls, directory: Path) -> WriterLock | None:
        """The lock of ``directory`` (``None``: none, or unreadable, or not naming a process)."""
        try:
            data = json.loads((directory / WRITER_FILE).read_text())
            lock = cls(int(data["pid"]), str(data["host"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return lock if lock.pid > 0 else None


def owner_is_gone(entry: Path) -> bool:
    """Whether the save that left ``entry`` (a ``*.tmp-*`` entry of the root) cannot complete any more.

    True for this process's own leftovers and for a writer that is a dead process of this
    host; false for a live writer, another host's writer or an entry without a lock (kept).
    """
    me = WriterLock.mine()
    if entry.is_dir() and not entry.is_symlink():
        lock = WriterLock.read(entry)
    else:  # ``.latest.tmp-<pid>``: written by write_text_atomic on the writer's host
        pid = entry.name.rpartition(".tmp-")[2]
        lock = WriterLock(int(pid), me.host) if pid.isdigit() and int(pid) > 0 else None
    if lock is None or lock.host != me.host:
        return False
    return lock.pid == me.pid or not pid_alive(lock.pid)
