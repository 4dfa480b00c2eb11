"""The run's state beside the model in a checkpoint: LR scheduler, client state, excluded parameters."""

from __future__ import annotations

import dataclasses
import io as _bytes_io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zero_full.checkpoint import io, safety
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.manifest import Manifest

__all__ = ["EMPTY", "EXTRAS_FILE", "Extras", "read_client_state", "read_extras"]

EXTRAS_FILE = "extras.pt"


@dataclasses.dataclass(frozen=True)
class Extras:
    """What ``extras.pt`` holds."""

    lr_scheduler: dict[str, Any] | None = None
    client_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    excluded_frozen: tuple[str, ...] = ()

    def payload(self) -> dict[str, Any]:
        """The object ``torch.save`` writes."""
        return {
            "lr_scheduler": self.lr_scheduler,
            "client_state": self.client_state,
            "excluded_frozen": list(self.excluded_frozen),
        }


EMPTY = Extras()


def build_extras(
    lr_scheduler: Any, client_state: Mapping[str, Any] | None, excluded_frozen: tuple[str, ...]
) -> Extras:
    """The extras of a save; checks that ``client_state`` can be read back without executing code.

    Raises:
        CheckpointError: ``client_state`` is not a mapping or holds an object that a
            ``weights_only`` load refuses (the message names the type to convert).
    """
    if client_state is not None and not isinstance(client_state, Mapping):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    sched = lr_scheduler.state_dict() if lr_scheduler is not None else None
    extras = Extras(sched, dict(client_state or {}), excluded_frozen)
    buf = _bytes_io.BytesIO()
    torch.save(extras.payload(), buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the reason
        raise CheckpointError(
            "client_state (or the LR scheduler's state_dict) holds a value that cannot be loaded "
            "without executing pickled code; keep to dicts, lists, numbers, strings and tensors "
            f"({exc})"
        ) from None
    return extras


def read_extras(path: Path, manifest: Manifest) -> Extras:
    """The extras of the checkpoint at ``path`` (verified against the manifest); :data:`EMPTY` if none.

    Raises:
        CheckpointError: the file is listed but missing or corrupt.
    """
    entry = next((f for f in manifest.files if f.name == EXTRAS_FILE), None)
    if entry is None:
        return EMPTY
    io.verify_file(path / EXTRAS_FILE, entry)
    data = torch.load(path / EXTRAS_FILE, map_location="cpu", weights_only=True)
    return Extras(data["lr_scheduler"], dict(data["client_state"]), tuple(data["excluded_frozen"]))


def read_client_state(directory: str | Path, tag: str | None = None) -> dict[str, Any]:
    """The ``client_state`` saved with ``directory/tag`` (``tag=None``: the one ``latest`` names).

    No collective: any rank (or a process outside the job) may call it.
    """
    directory = Path(directory)
    path = directory / safety.resolve_tag(directory, tag)
    return read_extras(path, Manifest.read(path)).client_state
