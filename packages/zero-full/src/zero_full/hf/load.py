"""Hugging Face checkpoints straight into ZeRO shards (and whole parameters for stages 0/1/2)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.profiler import record_function

import zero_params
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.layout import local_pieces
from zero_full.checkpoint.safetensors import SAFETENSORS_DTYPES
from zero_full.checkpoint.state import TrainState
from zero_full.wiring.init import ConfigLike, Init
from zero_params.partitioning import meta_target_device
from zero_params.transitions import reshard_from_full

__all__ = ["LoadReport", "from_pretrained", "load_safetensors_into"]

logger = logging.getLogger("zero.pretrained")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # header name -> dtype


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a load read and what did not match."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]
    max_read_bytes: int

    @property
    def ok(self) -> bool:
        """Nothing missing, unexpected or mismatched."""
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """The problems, one per line."""
        lines = [f"missing in the checkpoint: {k!r}" for k in self.missing]
        lines += [f"unexpected in the checkpoint (not in the model): {k!r}" for k in self.unexpected]
        lines += [f"shape mismatch: {m}" for m in self.mismatched]
        return "\n  ".join(lines)


# ---------------------------------------------------------------------------- checkpoint index


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


_MAX_HEADER = 100_000_000
"""The largest safetensors header read (the format's own limit is 100 MB)."""


def _read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte length + JSON; no tensor data is read).

    Every entry is checked against the file (a JSON object of tensors, each with a dtype, a
    shape and data offsets inside the file matching its size), so a malformed or hostile
    header is a :class:`CheckpointError` naming the file, never an ``OverflowError`` or a
    ``MemoryError`` from a huge length.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(
                    f"{path}: not a safetensors file (its header claims {n} bytes; the file has {size})"
                )
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read its safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (a JSON {type(header).__name__})")
    data = size - 8 - n
    for key, meta in header.items():
        if key != "__metadata__":
            _check_entry(path, key, meta, data)
    return header


def _check_entry(path: Path, key: str, meta: Any, data: int) -> None:
    """One header entry: dtype, shape and offsets inside the data section, sized like the tensor."""
    if isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and meta["dtype"] not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {key!r} has dtype {meta['dtype']} that zero cannot load")
    try:
        dtype = _ST_DTYPES[meta["dtype"]]
        shape = [int(d) for d in meta["shape"]]
        begin, end = (int(o) for o in meta["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed safetensors header entry {key!r} ({exc!r})") from None
    numel = 1
    for d in shape:
        numel *= d
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= data:
        raise CheckpointError(
            f"{path}: tensor {key!r} has offsets {begin}..{end} outside its {data} data bytes"
        )
    if end - begin != numel * dtype.itemsize:
        raise CheckpointError(
            f"{path}: tensor {key!r} of shape {shape} ({meta['dtype']}) needs {numel * dtype.itemsize} "
            f"bytes, its offsets hold {end - begin}"
        )


def checkpoint_index(path: str | os.PathLike[str]) -> dict[str, _TensorInfo]:
    """Every tensor of a safetensors checkpoint: key -> file, dtype, shape (headers only)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = [path / f for f in dict.fromkeys(weight_map.values())]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise CheckpointError(
            f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (save the model with save_pretrained(..., "
            "safe_serialization=True), or pass the .safetensors file)"
        )
    out: dict[str, _TensorInfo] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: named by {INDEX_FILE} but missing")
        for key, meta in _read_header(f).items():
            if key == "__metadata__":
                continue
            out[key] = _TensorInfo(f, _ST_DTYPES[meta["dtype"]], tuple(meta["shape"]))
    return out


# ---------------------------------------------------------------------------- range reads


def read_flat_range(info: _TensorInfo, key: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened tensor ``key``, reading only those bytes.

    The range is cut into at most ``2 * ndim - 1`` rectangular slices (partial first row,
    whole middle rows, partial last row, recursively), each read with ``get_slice``.
    """
    from safetensors import safe_open

    if stop <= start:
        return torch.empty(0, dtype=info.dtype)
    with safe_open(str(info.file), framework="pt") as f:
        sl = f.get_slice(key)
        parts = list(_range_slices(sl, (), info.shape, start, stop))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _range_slices(sl: Any, prefix: tuple[Any, ...], shape: Sequence[int], start: int, stop: int) -> Iterator:
    if len(shape) == 0:
        yield sl[prefix].reshape(-1) if prefix else sl[...].reshape(-1)
        return
    if len(shape) == 1:
        yield sl[(*prefix, slice(start, stop))].reshape(-1)
        return
    row = 1
    for d in shape[1:]:
        row *= d
    r0, r1 = start // row, (stop - 1) // row  # first and last row touched
    if r0 == r1:
        yield from _range_slices(sl, (*prefix, r0), shape[1:], start - r0 * row, stop - r0 * row)
        return
    first_whole = r0 if start == r0 * row else r0 + 1
    last_whole = r1 if stop == (r1 + 1) * row else r1 - 1
    if first_whole != r0:
        yield from _range_slices(sl, (*prefix, r0), shape[1:], start - r0 * row, row)
    if first_whole <= last_whole:
        yield sl[(*prefix, slice(first_whole, last_whole + 1))].reshape(-1)
    if last_whole != r1:
        yield from _range_slices(sl, (*prefix, r1), shape[1:], 0, stop - r1 * row)


# ---------------------------------------------------------------------------- key mapping


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One distinct model tensor and where its values go on this rank."""

    keys: tuple[str, ...]  # every state-dict key naming it (tied aliases)
    shape: tuple[int, ...]
    dest: torch.Tensor  # 1-D, ``stop - start`` elements
    start: int
    stop: int
    after: Callable[[], None] | None = None  # e.g. re-sync a persistent parameter's shard


def _file_key_for(model: nn.Module, model_keys: Sequence[str], file_keys: set[str]) -> Callable[[str], str]:
    """HF's prefix rule: add or strip ``base_model_prefix`` when model and file disagree on it."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return lambda k: k
    dotted = prefix + "."
    file_has = any(k.startswith(dotted) for k in file_keys)
    model_has = any(k.startswith(dotted) for k in model_keys)
    if model_has and not file_has:
        return lambda k: k[len(dotted) :] if k.startswith(dotted) else k
    if file_has and not model_has:
        return lambda k: dotted + k
    return lambda k: k


def _patterns(model: nn.Module, attr: str) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (getattr(model, attr, None) or ())]


def _fill(model: nn.Module, slots: list[_Slot], path: str | os.PathLike[str], *, strict: bool) -> LoadReport:
    """Read every slot's range from the checkpoint at ``path``; check names and shapes first."""
    index = checkpoint_index(path)
    model_keys = [k for s in slots for k in s.keys]
    to_file = _file_key_for(model, model_keys, set(index))
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    used: set[str] = set()
    missing: list[str] = []
    mismatched: list[str] = []
    plan: list[tuple[_Slot, str]] = []
    for slot in slots:
        found = [k for k in slot.keys if to_file(k) in index]
        used.update(to_file(k) for k in found)
        if not found:
            missing.extend(k for k in slot.keys[:1] if not any(p.search(k) for p in ignore_missing))
            continue
        fk = to_file(found[0])
        if index[fk].shape != slot.shape:
            mismatched.append(f"{found[0]!r}: model {list(slot.shape)} vs checkpoint {list(index[fk].shape)}")
            continue
        plan.append((slot, fk))
    unexpected = sorted(k for k in index if k not in used and not any(p.search(k) for p in ignore_unexpected))
    biggest = 0
    loaded = []
    with record_function("zero.pretrained.load"), torch.no_grad():
        for slot, fk in plan:
            info = index[fk]
            values = read_flat_range(info, fk, slot.start, slot.stop)
            biggest = max(biggest, values.numel() * values.element_size())
            slot.dest.copy_(values)
            del values
            if slot.after is not None:
                slot.after()
            loaded.append(fk)
    report = LoadReport(tuple(loaded), tuple(missing), tuple(unexpected), tuple(mismatched), biggest)
    if not report.ok:
        if strict:
            raise CheckpointError(
                f"checkpoint {path} does not match {type(model).__name__}:\n  {report.describe()}\n"
                "(pass strict=False to load what matches and get these in the returned LoadReport)"
            )
        logger.warning("zero: loading %s: %s", path, report.describe())
    return report


# ---------------------------------------------------------------------------- slots of a model


def _named_tensors(model: nn.Module) -> Iterator[tuple[torch.Tensor, list[str]]]:
    """Each distinct parameter / persistent buffer with every state-dict key naming it."""
    names: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set:
                continue
            key = f"{mod_name}.{bname}" if mod_name else bname
            names.setdefault(id(b), (b, []))[1].append(key)
    yield from names.values()


def _model_slots(model: nn.Module) -> list[_Slot]:
    """Where each tensor of a model (partitioned or whole, not inside an engine) is filled."""
    slots = []
    for t, keys in _named_tensors(model):
        if zero_params.is_partitioned(t):
            st = zero_params.state_of(t)
            shape = tuple(st.shape)
            if st.persistent:
                full = t.detach().reshape(-1)
                slots.append(_Slot(tuple(keys), shape, full, 0, st.numel, _resync(t, st)))
                continue
            start, stop = st.shard_range
            if st.offload is not None:
                values = torch.zeros(st.partition_numel, dtype=st.dtype, device=st.device)
                slots.append(
                    _Slot(tuple(keys), shape, values[: stop - start], start, stop, _replace(st, values))
                )
            else:
                slots.append(_Slot(tuple(keys), shape, st.shard[: stop - start], start, stop))
            continue
        if t.is_meta:
            raise CheckpointError(
                f"{keys[0]!r} is on the meta device: materialise the model first (zero_full.from_pretrained "
                "does it), or build it under zero_full.Init"
            )
        slots.append(_Slot(tuple(keys), tuple(t.shape), t.detach().reshape(-1), 0, t.numel()))
    return slots


def _resync(p: torch.Tensor, st: zero_params.ShardedParam) -> Callable[[], None]:
    return lambda: reshard_from_full(p, st)


def _replace(st: zero_params.ShardedParam, values: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        if st.offload is not None:
            st.offload.replace(st, values)

    return run


def load_safetensors_into(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> LoadReport:
    """Fill an already built model (partitioned or whole) from a safetensors checkpoint.

    Each rank reads only what it keeps: its shard of every partitioned parameter, whole
    persistent parameters, whole parameters and persistent buffers of unpartitioned
    modules. No communication. For a model inside an :class:`~zero_full.Engine` use
    :meth:`Engine.load_pretrained` (it also refreshes the optimizer's fp32 master).
    """
    return _fill(model, _model_slots(model), path, strict=strict)


def load_into_state(state: TrainState, path: str | os.PathLike[str], *, strict: bool = True) -> LoadReport:
    """:meth:`zero_full.Engine.load_pretrained`: fill the engine's fp32 masters (trainable
    parameters) and working tensors (frozen ones, buffers) from a checkpoint, then publish
    the new values to the working parameters (every stage; collective for replicated pieces).

    The optimizer's state (e.g. Adam's moments) is left as it is.
    """
    module = state.module
    pieces = local_pieces(module, state.optimizer)
    by_id = {id(p): name for name, p in module.named_parameters()}
    slots = []
    for t, keys in _named_tensors(module):
        name = by_id.get(id(t))
        if name is None:  # a buffer
            slots.append(_Slot(tuple(keys), tuple(t.shape), t.detach().reshape(-1), 0, t.numel()))
            continue
        pc = pieces[name]
        slots.append(_Slot(tuple(keys), pc.shape, pc.padded[: pc.stop - pc.start], pc.start, pc.stop))
    report = _fill(module, slots, path, strict=strict)
    state.optimizer.publish_updated_shards()
    with torch.no_grad():
        frozen = [p for n, p in module.named_parameters() if not pieces[n].trainable]
        partitioned = [p for p in frozen if zero_params.is_partitioned(p)]
        if partitioned:
            zero_params.commit_shards(partitioned)
    return report


# ---------------------------------------------------------------------------- building on meta


class MetaParameters:
    """Inside the block, every parameter a module registers is replaced by a ``meta`` one."""

    def __init__(self, skip_hf_init: bool = False) -> None:
        self.skip_hf_init = skip_hf_init
        self._handle: Any = None

    def __enter__(self) -> MetaParameters:
        self._handle = register_module_parameter_registration_hook(self._to_meta)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _to_meta(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or type(param) is not nn.Parameter or param.is_meta or "_zero" in param.__dict__:
            return None
        if self.skip_hf_init:
            module._is_hf_initialized = True
        return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)


def materialize_meta(model: nn.Module, device: torch.device | None = None) -> None:
    """Give every ``meta`` parameter of a whole (unpartitioned) model real, uninitialised
    storage on ``device`` (default: the accelerator or CPU), keeping tied parameters tied."""
    device = device if device is not None else meta_target_device()
    done: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = done.get(id(p))
            if new is None:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                done[id(p)] = new
            mod._parameters[name] = new


# ---------------------------------------------------------------------------- from_pretrained


def _build(model_class_or_callable: Any, path: Path, model_config: Any) -> nn.Module:
    if isinstance(model_class_or_callable, type):
        config_class = getattr(model_class_or_callable, "config_class", None)
        if config_class is not None:  # a transformers model class
            hf_config = model_config if model_config is not None else config_class.from_pretrained(path)
            return model_class_or_callable(hf_config)
        if hasattr(model_class_or_callable, "from_config"):  # an AutoModel... class
            if model_config is None:
                from transformers import AutoConfig

                model_config = AutoConfig.from_pretrained(path)
            return model_class_or_callable.from_config(model_config)
    if model_config is not None:
        return model_class_or_callable(model_config)
    return model_class_or_callable()


def from_pretrained(
    model_class_or_callable: type[nn.Module] | Callable[..., nn.Module],
    path: str | os.PathLike[str],
    config: ConfigLike = None,
    *,
    model_config: Any = None,
    strict: bool = True,
) -> nn.Module:
    """Build a model and load a safetensors checkpoint straight into this rank's shards.

    The model is built on ``meta`` (no full weight is ever allocated); at stage 3 each parameter
    is partitioned as it is built (:class:`zero_full.Init`) and each rank reads only its shards.
    Returns the model in ``eval()`` mode; pass it to :func:`zero_full.initialize`.
    """
    path = Path(path)
    with record_function("zero.pretrained.build"):
        hf = any(c.__name__ == "PreTrainedModel" for c in getattr(model_class_or_callable, "__mro__", ()))
        with (
            MetaParameters(skip_hf_init=hf),
            Init(config=config) if config is not None else contextlib.nullcontext(),
        ):
            model = _build(model_class_or_callable, path, model_config)
        materialize_meta(model)
    load_safetensors_into(model, path, strict=strict)
    return model.eval()
