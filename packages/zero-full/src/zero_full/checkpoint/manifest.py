"""The manifest of a checkpoint (``DIR/TAG/manifest.json``) as typed, frozen objects."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Self

from zero_full.checkpoint.io import FORMAT_NAME, FORMAT_VERSION, MANIFEST, READABLE_VERSIONS, CheckpointError

__all__ = [
    "FileEntry",
    "Manifest",
    "SavedBuffer",
    "SavedOptimizerGroup",
    "SavedParam",
    "StateDictKey",
]


def _digest(data: dict[str, Any]) -> str:
    """sha256 of the manifest's JSON text (``indent=1``) without its ``manifest_sha256`` key."""
    return hashlib.sha256(json.dumps(data, indent=1).encode("utf-8")).hexdigest()


def _jsonable(value: Any) -> Any:
    """Tuples (and tuples of tuples) as JSON lists; everything else as it is."""
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value)


def _pieces(value: Any) -> tuple[tuple[str, int, int], ...]:
    return tuple((str(n), int(a), int(b)) for n, a, b in value)


class _FlatRecord:
    """A manifest record whose JSON keys are its dataclass fields, in order.

    ``to_json`` writes each field (tuples as lists); ``from_json`` reads it back through the
    subclass' ``_PARSE`` table, one converter per field in field order.
    """

    __slots__ = ()
    _PARSE: ClassVar[tuple[Callable[[Any], Any], ...]]

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON form."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        """Parse the manifest's JSON form."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        return cls(*(parse(data[f.name]) for f, parse in zip(fields, cls._PARSE, strict=True)))


@dataclasses.dataclass(frozen=True)
class FileEntry(_FlatRecord):
    """One file of a checkpoint as the manifest lists it."""

    name: str
    size: int
    sha256: str
    rank: int
    pieces: tuple[tuple[str, int, int], ...]

    _PARSE: ClassVar[tuple[Callable[[Any], Any], ...]] = (str, int, str, int, _pieces)


@dataclasses.dataclass(frozen=True)
class SavedParam:
    """One parameter as saved: its shape and how it was partitioned when written."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    trainable: bool
    optimizer_group: int | None
    partition_numel: int
    world: int

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON form."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "numel": self.numel,
            "trainable": self.trainable,
            "optimizer_group": self.optimizer_group,
            "partitioning": {
                "numel": self.numel,
                "partition_numel": self.partition_numel,
                "world": self.world,
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SavedParam:
        """Parse the manifest's JSON form."""
        part = data["partitioning"]
        group = data["optimizer_group"]
        return cls(
            str(data["name"]),
            _int_tuple(data["shape"]),
            str(data["dtype"]),
            int(data["numel"]),
            bool(data["trainable"]),
            None if group is None else int(group),
            int(part["partition_numel"]),
            int(part["world"]),
        )


@dataclasses.dataclass(frozen=True)
class SavedBuffer(_FlatRecord):
    """A buffer of ``model.state_dict()`` as saved (its values are in ``buffers.pt``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    _PARSE: ClassVar[tuple[Callable[[Any], Any], ...]] = (str, _int_tuple, str)


@dataclasses.dataclass(frozen=True)
class StateDictKey(_FlatRecord):
    """A key of ``model.state_dict()``: a parameter (``source``: its canonical name) or a buffer."""

    key: str
    kind: str
    source: str

    _PARSE: ClassVar[tuple[Callable[[Any], Any], ...]] = (str, str, str)


@dataclasses.dataclass(frozen=True)
class SavedOptimizerGroup(_FlatRecord):
    """One torch optimizer group: hyperparameters, scalar state and the per-element state's dtypes."""

    hyperparameters: dict[str, Any]
    scalar_state: dict[str, dict[str, Any]]
    elementwise_state: dict[str, str]

    _PARSE: ClassVar[tuple[Callable[[Any], Any], ...]] = (dict, dict, dict)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything a checkpoint holds besides the tensors, and where those are."""

    tag: str
    created_unix: float
    torch_version: str
    world_size: int
    stage: int
    partition_layout: dict[str, Any]
    global_steps: int
    micro_steps: int
    gradient_accumulation_steps: int
    config: dict[str, Any]
    params: tuple[SavedParam, ...]
    buffers: tuple[SavedBuffer, ...]
    state_dict_keys: tuple[StateDictKey, ...]
    optimizer_type: str
    optimizer_groups: tuple[SavedOptimizerGroup, ...]
    loss_scaler: dict[str, Any] | None
    files: tuple[FileEntry, ...]

    def to_json(self) -> str:
        """The text of ``manifest.json`` (the current format version, with its own sha256)."""
        data = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "tag": self.tag,
            "created_unix": self.created_unix,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "stage": self.stage,
            "partition_layout": self.partition_layout,
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "config": self.config,
            "params": [p.to_json() for p in self.params],
            "buffers": [b.to_json() for b in self.buffers],
            "state_dict_keys": [k.to_json() for k in self.state_dict_keys],
            "optimizer": {
                "type": self.optimizer_type,
                "groups": [g.to_json() for g in self.optimizer_groups],
            },
            "loss_scaler": self.loss_scaler,
            "files": [f.to_json() for f in self.files],
        }
        data["manifest_sha256"] = _digest(data)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        """Parse ``manifest.json``'s text.

        Raises:
            CheckpointError: not JSON, another format, a newer format version or a missing key
                (the message names ``where``).
        """
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{where} is corrupt: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            fmt = data.get("format") if isinstance(data, dict) else None
            raise CheckpointError(f"{where} is not a zero checkpoint manifest (format {fmt!r})")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{where} has format version {version!r}; this zero reads versions {READABLE_VERSIONS}"
            )
        if version >= 2:
            claimed = data.pop("manifest_sha256", None)
            actual = _digest(data)
            if claimed != actual:
                raise CheckpointError(
                    f"{where} is corrupt: its content's sha256 {actual} differs from the recorded "
                    f"manifest_sha256 {claimed!r}; re-save the checkpoint or use another tag"
                )
        try:
            return cls._parse(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where} is corrupt: bad or missing entry {exc}") from None

    @classmethod
    def _parse(cls, data: dict[str, Any]) -> Manifest:
        opt = data["optimizer"]
        return cls(
            tag=str(data["tag"]),
            created_unix=data["created_unix"],
            torch_version=str(data["torch_version"]),
            world_size=int(data["world_size"]),
            stage=int(data["stage"]),
            partition_layout=dict(data["partition_layout"]),
            global_steps=int(data["global_steps"]),
            micro_steps=int(data["micro_steps"]),
            gradient_accumulation_steps=int(data["gradient_accumulation_steps"]),
            config=dict(data["config"]),
            params=tuple(SavedParam.from_json(p) for p in data["params"]),
            buffers=tuple(SavedBuffer.from_json(b) for b in data["buffers"]),
            state_dict_keys=tuple(StateDictKey.from_json(k) for k in data["state_dict_keys"]),
            optimizer_type=str(opt["type"]),
            optimizer_groups=tuple(SavedOptimizerGroup.from_json(g) for g in opt["groups"]),
            loss_scaler=data["loss_scaler"],
            files=tuple(FileEntry.from_json(f) for f in data["files"]),
        )

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Read and check ``path/manifest.json``.

        Raises:
            CheckpointError: missing, not JSON, another format or a newer format version.
        """
        file = path / MANIFEST
        if not file.is_file():
            raise CheckpointError(f"{path} is not a zero checkpoint: {file} is missing")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{file} is corrupt: {exc}") from None
        return cls.from_json(text, str(file))

    def param(self, name: str) -> SavedParam | None:
        """The saved parameter ``name``, or ``None``."""
        return next((p for p in self.params if p.name == name), None)
