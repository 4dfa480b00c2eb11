"""``engine.save_pretrained(dir)``: the trained weights in the Hugging Face layout, streamed.

``config.json`` and ``model.safetensors`` (sharded with an index above ``max_shard_size``), so
that ``from_pretrained(dir)`` in a plain process gives exactly the trained weights. Every rank
joins one all-gather per parameter; rank 0 writes each tensor as soon as it is gathered.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zero_full.checkpoint.consolidate import gather_full, state_dict_buffers, state_dict_keys
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.layout import local_pieces
from zero_full.checkpoint.manifest import StateDictKey
from zero_full.checkpoint.safetensors import CheckpointReader, SafetensorsWriter
from zero_full.checkpoint.state import TrainState
from zero_full.hf.load import INDEX_FILE, SINGLE_FILE
from zero_full.hf.publish import publish_weights

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "SavedPretrained",
    "consolidate_checkpoint_hf",
    "parse_size",
    "plan_shards",
    "save_pretrained",
]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' default ("5GB")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """Bytes from an int or a ``transformers``-style size string (``"5GB"``, ``"200MiB"``, ``"20KB"``).

    Raises:
        ValueError: an unparseable or non-positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"max_shard_size={size!r}: expected bytes (int) or a size like '5GB' / '200MiB'")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


def plan_shards(sizes: list[int], max_shard_size: int) -> list[list[int]]:
    """Split tensors (their byte sizes, in write order) into consecutive shards.

    A shard is closed before the tensor that would take it over ``max_shard_size``; a
    tensor larger than the limit gets a shard of its own (as ``transformers`` does).
    Returns the tensor indices of each shard (at least one shard, possibly empty).
    """
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def shard_file_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000x-of-0000y.safetensors``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


@dataclasses.dataclass(frozen=True)
class SavedPretrained:
    """What :func:`save_pretrained` wrote (the same on every rank)."""

    directory: Path
    files: tuple[str, ...]
    tensors: int
    nbytes: int
    max_tensor_bytes: int


def _entries(state: TrainState, dtype: torch.dtype | None) -> list[tuple[StateDictKey, torch.dtype, tuple]]:
    """``(state-dict entry, saved dtype, shape)`` of each tensor to write (tied duplicates dropped)."""
    pieces = local_pieces(state.module, state.optimizer)
    buffers = state_dict_buffers(state.module)
    seen: set[str] = set()
    out = []
    for e in state_dict_keys(state.module):
        if e.kind == "param":
            if e.source in seen:
                continue
            seen.add(e.source)
            pc = pieces[e.source]
            # the trained values: the fp32 master (fp32 for every floating parameter)
            saved = torch.float32 if pc.dtype.is_floating_point else pc.dtype
            out.append((e, dtype if dtype is not None and saved.is_floating_point else saved, pc.shape))
        else:
            b = buffers[e.source]
            out.append((e, b.dtype, tuple(b.shape)))
    return out


def save_pretrained(
    state: TrainState,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> SavedPretrained:
    """Write the engine's weights (and the model's HF config) to ``directory`` in the HF layout.

    Collective: call on every rank. See the module docstring.
    """
    directory = Path(directory)
    limit = parse_size(max_shard_size)
    root = dist.get_rank() == 0
    entries = _entries(state, dtype)
    sizes = [_numel(shape) * torch.empty((), dtype=dt).element_size() for _, dt, shape in entries]
    shards = plan_shards(sizes, limit)
    names = shard_file_names(len(shards))
    if root:
        directory.mkdir(parents=True, exist_ok=True)
        _save_configs(state.module, directory)
    pieces = local_pieces(state.module, state.optimizer)
    buffers = state_dict_buffers(state.module)
    weight_map: dict[str, str] = {}
    written: dict[str, Path] = {}
    with record_function("zero.save_pretrained"), torch.no_grad():
        for fname, idx in zip(names, shards, strict=True):
            todo = [entries[i] for i in idx]
            tmp = directory / f".{fname}.tmp-{os.getpid()}"
            written[fname] = tmp
            f = open(tmp, "wb") if root else None  # noqa: SIM115  (closed below, after the gathers)
            try:
                writer = (
                    SafetensorsWriter(f, [(e.key, dt, s) for e, dt, s in todo], {"format": "pt"})
                    if f is not None
                    else None
                )
                for e, dt, shape in todo:
                    if e.kind == "param":
                        full = gather_full(pieces[e.source])
                    else:
                        full = buffers[e.source].detach()
                    if writer is not None:
                        writer.write(e.key, full.to("cpu", dt).reshape(shape))
                    del full
                    weight_map[e.key] = fname
                if writer is not None and f is not None:
                    writer.finish()
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                if f is not None:
                    f.close()
        if root:
            publish_weights(directory, written, _index(names, sizes, weight_map))
    dist.barrier()
    return SavedPretrained(directory, tuple(names), len(entries), sum(sizes), max(sizes, default=0))


def _index(names: list[str], sizes: list[int], weight_map: dict[str, str]) -> tuple[str, str] | None:
    """HF's weight index ``(name, text)`` for several weight files; ``None`` for a single file."""
    if len(names) == 1:
        return None
    body = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    return INDEX_FILE, json.dumps(body, indent=2, sort_keys=True) + "\n"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _save_configs(module: Any, directory: Path) -> None:
    for attr in ("config", "generation_config"):
        cfg = getattr(module, attr, None)
        save = getattr(cfg, "save_pretrained", None)
        if callable(save):
            save(directory)


def _write_shards(
    directory: Path,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Any,
    limit: int,
) -> SavedPretrained:
    """Write ``entries`` (produced one at a time by ``produce(i)``) as HF weight files + index."""
    sizes = [_numel(shape) * torch.empty((), dtype=dt).element_size() for _, dt, shape in entries]
    shards = plan_shards(sizes, limit)
    names = shard_file_names(len(shards))
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    written: dict[str, Path] = {}
    try:
        for fname, idx in zip(names, shards, strict=True):
            written[fname] = tmp = directory / f".{fname}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                writer = SafetensorsWriter(f, [entries[i] for i in idx], {"format": "pt"})
                for i in idx:
                    key, dt, shape = entries[i]
                    writer.write(key, produce(i).to("cpu", dt).reshape(shape))
                    weight_map[key] = fname
                writer.finish()
                f.flush()
                os.fsync(f.fileno())
        publish_weights(directory, written, _index(names, sizes, weight_map))
    finally:
        for tmp in written.values():
            tmp.unlink(missing_ok=True)
    return SavedPretrained(directory, tuple(names), len(entries), sum(sizes), max(sizes, default=0))


def consolidate_checkpoint_hf(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    tag: str | None = None,
    *,
    config: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    verify: bool = True,
) -> SavedPretrained:
    """``zero consolidate --hf``: a sharded zero checkpoint -> a Hugging Face model directory, offline."""
    checkpoint, out = Path(checkpoint), Path(out)
    cfg_file = None
    if config is not None:
        cfg_file = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
        if not cfg_file.is_file():
            raise CheckpointError(f"--config {config}: no config.json there")
    reader = CheckpointReader(checkpoint, tag, verify=verify)
    chosen = reader.entries(tied_once=True)
    entries = [(key, dtype, shape) for key, dtype, shape, _ in chosen]

    def produce(i: int) -> torch.Tensor:
        _, dtype, _, entry = chosen[i]
        return reader.tensor(entry, dtype)

    saved = _write_shards(out, entries, produce, parse_size(max_shard_size))
    if cfg_file is not None:
        shutil.copyfile(cfg_file, out / "config.json")
    return saved
