"""Offline consolidation: a sharded checkpoint -> one ``.safetensors`` file, streamed."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zero_full.checkpoint import io as ckpt_io
from zero_full.checkpoint import safety
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.layout import covered_prefix
from zero_full.checkpoint.manifest import Manifest, StateDictKey

__all__ = [
    "SAFETENSORS_DTYPES",
    "CheckpointReader",
    "ConsolidateResult",
    "SafetensorsWriter",
    "consolidate_checkpoint",
]

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""The torch dtypes safetensors holds, with their names in a file's header."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor, in the order declared up front."""

    __slots__ = ("_entries", "_f", "_next")

    def __init__(
        self,
        f: BinaryIO,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        if sys.byteorder != "little":
            raise ValueError("writing safetensors needs a little-endian host")
        self._entries = [_Entry(n, d, tuple(int(x) for x in s)) for n, d, s in entries]
        header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for e in self._entries:
            if e.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {e.name!r}: safetensors cannot store dtype {e.dtype}")
            if e.name in header:
                raise ValueError(f"tensor name {e.name!r} appears twice")
            header[e.name] = {
                "dtype": SAFETENSORS_DTYPES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        self._f = f
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (must be the next declared one, with its dtype and shape).

        Raises:
            ValueError: out of order, or another dtype / shape than declared.
        """
        if self._next >= len(self._entries):
            raise ValueError(f"tensor {name!r} was not declared")
        e = self._entries[self._next]
        if name != e.name or tensor.dtype != e.dtype or tuple(tensor.shape) != e.shape:
            raise ValueError(
                f"expected tensor {e.name!r} {e.dtype} {list(e.shape)} next, got {name!r} "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._f.write(data.numpy().tobytes())
        self._next += 1

    def finish(self) -> None:
        """Check that every declared tensor was written.

        Raises:
            ValueError: some were not.
        """
        if self._next != len(self._entries):
            missing = [e.name for e in self._entries[self._next :]]
            raise ValueError(f"{len(missing)} declared tensor(s) not written: {missing[:5]}")


@dataclasses.dataclass(frozen=True)
class ConsolidateResult:
    """What :func:`consolidate_checkpoint` wrote."""

    path: Path
    tag: str
    tensors: int
    nbytes: int
    max_tensor_bytes: int


def consolidate_checkpoint(
    directory: str | Path, out: str | Path, tag: str | None = None, *, verify: bool = True
) -> ConsolidateResult:
    """Write a checkpoint's full fp32 weights (and buffers) to one safetensors file.

    Keys are ``model.state_dict()``'s (tied parameters appear under each key). The output
    is written to a temporary name and renamed when complete.
    """
    out = Path(out)
    reader = CheckpointReader(directory, tag, verify=verify)
    entries = reader.entries()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    total = biggest = 0
    try:
        with open(tmp, "wb") as f:
            specs = [(key, dtype, shape) for key, dtype, shape, _ in entries]
            writer = SafetensorsWriter(f, specs, {"format": "pt", "zero_checkpoint_tag": reader.tag})
            for key, dtype, shape, entry in entries:
                tensor = reader.tensor(entry, dtype)
                writer.write(key, tensor.reshape(shape))
                nbytes = tensor.numel() * tensor.element_size()
                total += nbytes
                biggest = max(biggest, nbytes)
                del tensor
            writer.finish()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return ConsolidateResult(out, reader.tag, len(entries), total, biggest)


Entry = tuple[str, torch.dtype, tuple[int, ...], StateDictKey]
"""``(state_dict key, dtype, shape, manifest entry)`` of one saved tensor."""


class CheckpointReader:
    """A saved checkpoint read offline, one full tensor at a time (no process group)."""

    def __init__(self, directory: str | Path, tag: str | None = None, *, verify: bool = True) -> None:
        directory = Path(directory)
        self.tag = safety.resolve_tag(directory, tag)
        self.path = directory / self.tag
        self.manifest = Manifest.read(self.path)
        files = self.manifest.files
        if verify:
            for f in files:
                ckpt_io.verify_file(safety.inside(self.path, f.name, f"{self.path / ckpt_io.MANIFEST}"), f)
        self._params = {p.name: p for p in self.manifest.params}
        self._buffers = {b.name: b for b in self.manifest.buffers}
        self._where: dict[str, list[tuple[str, int, int]]] = {}
        for f in files:
            for name, a, b in f.pieces:
                self._where.setdefault(name, []).append((f.name, a, b))
        self._opened: dict[str, Any] = {}

    def entries(self, *, tied_once: bool = False) -> list[Entry]:
        """``(state_dict key, dtype, shape, manifest entry)`` per tensor, in ``state_dict`` order.

        Floating-point parameters are fp32 (the masters); ``tied_once`` keeps a tied
        parameter under its first key only (as ``transformers`` saves it).
        """
        out, seen = [], set()
        for e in self.manifest.state_dict_keys:
            if tied_once and e.kind == "param" and e.source in seen:
                continue
            seen.add(e.source)
            src = self._params[e.source] if e.kind == "param" else self._buffers[e.source]
            dtype = ckpt_io.dtype_from_name(src.dtype)
            if e.kind == "param" and dtype.is_floating_point:
                dtype = torch.float32
            out.append((e.key, dtype, tuple(src.shape), e))
        return out

    def tensor(self, entry: StateDictKey, dtype: torch.dtype) -> torch.Tensor:
        """The full (flattened, for parameters) tensor of one manifest entry.

        Raises:
            CheckpointError: the saved pieces of a parameter do not cover it.
        """
        name = entry.source
        if entry.kind != "param":
            return self._read(ckpt_io.BUFFERS_FILE, lambda shard: shard["buffers"][name])
        numel = self._params[name].numel
        pieces = self._where.get(name, [])
        pos = covered_prefix([(a, b) for _, a, b in pieces])
        if pos < numel:
            raise CheckpointError(
                f"the checkpoint's pieces of parameter {name!r} cover only [0, {pos}) of {numel}"
            )
        full = torch.empty(numel, dtype=dtype)
        for fname, a, b in pieces:
            if b > a:
                full[a:b].copy_(self._read(fname, lambda shard: shard["params"][name]["value"]))
        return full

    def _read(self, fname: str, pick: Any) -> torch.Tensor:
        """``pick(shard)`` of one shard file; a malformed file raises naming it."""
        shard = self._shard(fname)
        try:
            value = pick(shard)
        except (KeyError, TypeError, IndexError) as exc:
            raise CheckpointError(f"checkpoint file {self.path / fname} lacks {exc} (corrupt)") from None
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"checkpoint file {self.path / fname} holds no tensor where expected")
        return value

    def _shard(self, fname: str) -> Any:
        if fname not in self._opened:
            where = f"{self.path / ckpt_io.MANIFEST}"
            self._opened[fname] = ckpt_io.open_shard(safety.inside(self.path, fname, where))
        return self._opened[fname]
