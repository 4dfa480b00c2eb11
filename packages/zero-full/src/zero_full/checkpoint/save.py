"""Writing a sharded, atomic checkpoint: :func:`save_checkpoint`."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import os
import random
import secrets
import shutil
import socket
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zero_full.checkpoint import hygiene, io, safety
from zero_full.checkpoint.collectives import exchange, raise_if_failed
from zero_full.checkpoint.consolidate import state_dict_buffers, state_dict_keys
from zero_full.checkpoint.extras import EXTRAS_FILE, build_extras
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.layout import covered_prefix, elementwise_state, local_pieces
from zero_full.checkpoint.manifest import FileEntry, Manifest, SavedBuffer, SavedOptimizerGroup, SavedParam
from zero_full.checkpoint.state import TrainState

__all__ = ["SaveOptions", "save_checkpoint"]


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How a save treats what is beside the sharded model state."""

    client_state: Mapping[str, Any] | None = None
    save_latest: bool = True
    exclude_frozen_parameters: bool = False
    overwrite: bool = False


logger = logging.getLogger("zero.checkpoint")


@dataclasses.dataclass(frozen=True)
class _SavePlan:
    directory: Path
    tag: str
    tmp: Path
    timeout: float
    options: SaveOptions
    replaces: bool = False


def save_checkpoint(
    state: TrainState,
    directory: str | Path,
    tag: str | None = None,
    *,
    timeout: float | None = None,
    options: SaveOptions | None = None,
) -> Path:
    """Write a sharded checkpoint of ``state`` to ``directory/tag`` (call on every rank).

    ``tag`` defaults to ``global_step{N}``; an existing published tag is refused unless
    ``options.overwrite``. Returns ``directory/tag``. Raises :class:`CheckpointError` on every
    rank, naming the failing ranks, when a save cannot complete (nothing is left under ``tag``).
    """
    directory = Path(directory)
    options = options if options is not None else SaveOptions()
    tag = tag if tag is not None else f"global_step{state.counters.global_steps}"
    wait = state.timeout if timeout is None else timeout
    rank = dist.get_rank()
    with record_function("zero.checkpoint.save"):
        err = _tag_problem(tag)
        _warn_if_accumulating(state, rank)
        tmp_name, replaces = "", False
        if rank == 0 and err is None:
            try:
                tmp_name, replaces = _begin(directory, tag, options.overwrite)
            except (OSError, CheckpointError) as exc:
                err = str(exc)
        try:
            first = exchange({"error": err, "tmp": tmp_name, "tag": tag}, wait)
            raise_if_failed([s["error"] for s in first], f"saving checkpoint {directory / tag}")
            _agree_on_tag([s["tag"] for s in first], "save_checkpoint")
        except CheckpointError:
            if tmp_name:  # rank 0: nobody else will use this directory
                shutil.rmtree(directory / tmp_name, ignore_errors=True)
            raise
        plan = _SavePlan(directory, tag, directory / first[0]["tmp"], wait, options, replaces)
        if rank == 0:  # every rank is in this save: no other save of this job is writing
            hygiene.remove_stale(directory, keep=plan.tmp.name)
        try:
            # offloaded optimizer state is read back from host memory / swap files for the save
            with state.optimizer.materialized_state(write_back=False):
                _save_in_tmp(state, plan)
        except BaseException:
            if rank == 0:
                shutil.rmtree(plan.tmp, ignore_errors=True)
            raise
    return directory / tag


def _tag_problem(tag: str) -> str | None:
    """Why ``tag`` cannot be saved (the rule loading applies), or ``None``."""
    try:
        safety.validate_tag(tag)
    except CheckpointError as exc:
        return str(exc)
    return None


def _agree_on_tag(tags: list[str], call: str) -> None:
    """Raise on every rank unless every rank named the same tag."""
    if len(set(tags)) > 1:
        named = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise CheckpointError(
            f"{call}: the ranks named different tags ({named}); pass the same tag on every rank "
            "(e.g. derived from engine.global_steps, not from a per-rank value)"
        )


def _warn_if_accumulating(state: TrainState, rank: int) -> None:
    """Saving between accumulation boundaries loses the gradients accumulated so far: say so."""
    c = state.counters
    pending = c.micro_steps % c.gradient_accumulation_steps
    if pending:
        message = (
            f"save_checkpoint at micro-step {c.micro_steps}, in the middle of gradient accumulation "
            f"({pending} of {c.gradient_accumulation_steps} micro-batches accumulated): accumulated "
            "gradients are not saved, so a run resumed from it differs from one that went on. Save "
            "at a boundary (engine.is_gradient_accumulation_boundary() before the step)"
        )
        warnings.warn(message, UserWarning, stacklevel=3)
        if rank == 0:
            logger.warning("zero: %s", message)


def _begin(directory: Path, tag: str, overwrite: bool) -> tuple[str, bool]:
    """Rank 0: create the save's temporary directory (with its writer lock)."""
    directory.mkdir(parents=True, exist_ok=True)
    replaces = False
    if overwrite and (directory / tag).exists():
        replaces = True
    elif (directory / tag).exists():
        if not _unpublished(directory, tag):
            raise CheckpointError(
                f"checkpoint {directory / tag} exists already; save under another tag, remove it "
                "or pass overwrite=True to replace it"
            )
        logger.warning(
            "zero: %s was renamed into place by a save that stopped before updating 'latest': "
            "this save replaces it",
            directory / tag,
        )
        replaces = True
    tmp_name = f"{tag}.tmp-{secrets.token_hex(6)}"
    (directory / tmp_name).mkdir()
    safety.WriterLock.mine().write(directory / tmp_name)
    return tmp_name, replaces


def _unpublished(directory: Path, tag: str) -> bool:
    """Whether ``directory/tag`` never became ``latest``: no ``latest``, or one older than its manifest."""
    try:
        created = Manifest.read(directory / tag).created_unix
    except CheckpointError:
        return False  # not a complete checkpoint of ours: never replaced
    latest = directory / io.LATEST
    if not latest.is_file():
        return True
    try:
        named = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return named != tag and latest.stat().st_mtime < created


def _save_in_tmp(state: TrainState, plan: _SavePlan) -> None:
    rank = dist.get_rank()
    info: list[dict[str, Any]] | None = None
    err = None
    failure: BaseException | None = None
    written: list[tuple[str, Any, tuple[Any, ...]]] = []
    try:
        written = _rank_files(state, plan.options)
        need = hygiene.tensor_bytes([obj for _, obj, _ in written])
    except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised below
        err, failure, need = f"{type(exc).__name__}: {exc}", exc, 0
    sizes = exchange({"error": err, "host": socket.gethostname(), "need": need}, plan.timeout)
    if err is None and not any(s["error"] for s in sizes):
        host_need = sum(s["need"] for s in sizes if s["host"] == sizes[rank]["host"])
        try:
            hygiene.check_free_space(plan.tmp, host_need, rank, str(plan.directory / plan.tag))
            info = _write_files(written, plan.tmp, rank)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised below
            err, failure = f"{type(exc).__name__}: {exc}", exc
    del written
    statuses = exchange({"error": err, "files": info}, plan.timeout)
    try:
        errors = [s["error"] or z["error"] for s, z in zip(statuses, sizes)]
        raise_if_failed(errors, f"saving checkpoint {plan.directory / plan.tag}")
    except CheckpointError as exc:
        raise exc from failure
    err = None
    if rank == 0:
        try:
            files = [FileEntry.from_json(f) for s in statuses for f in s["files"]]
            skip = _excluded(state, plan.options)
            _publish(build_manifest(state, plan.tag, files, skip), plan, rank)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            err = f"{type(exc).__name__}: {exc}"
    done = exchange(err, plan.timeout)
    raise_if_failed(done, f"saving checkpoint {plan.directory / plan.tag}")


def _publish(manifest: Manifest, plan: _SavePlan, rank: int) -> None:
    """Write the manifest, rename the temporary directory to the tag, move ``latest`` (rank 0).

    An existing tag (``overwrite``) is exchanged with the new directory in one rename; the
    old one, now under the temporary name, is removed after.
    """
    try:
        io.write_text_atomic(plan.tmp / io.MANIFEST, manifest.to_json())
    except OSError as exc:
        raise hygiene.write_error(plan.tmp / io.MANIFEST, rank, exc) from exc
    target = plan.directory / plan.tag
    if plan.replaces and target.exists():  # one atomic exchange: DIR/TAG is always complete
        _exchange_dirs(plan.tmp, target)
        io.fsync_dir(plan.directory)
        shutil.rmtree(plan.tmp, ignore_errors=True)  # now the replaced checkpoint
    else:
        plan.tmp.rename(target)
        io.fsync_dir(plan.directory)
    if plan.options.save_latest:
        io.write_text_atomic(plan.directory / io.LATEST, plan.tag)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange_dirs(a: Path, b: Path) -> None:
    """Atomically swap two directory entries (``renameat2(RENAME_EXCHANGE)``).

    Raises:
        CheckpointError: the OS has no atomic exchange (the old tag is left as it was; save
            under a new tag instead).
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    at_fdcwd = -100
    if (
        renameat2 is None
        or renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0
    ):
        err = ctypes.get_errno() if renameat2 is not None else 0
        raise CheckpointError(
            f"cannot replace checkpoint {b} atomically ({os.strerror(err) if err else 'no renameat2'}); "
            "it is left as it was: save under another tag"
        )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _excluded(state: TrainState, options: SaveOptions) -> tuple[str, ...]:
    """The frozen parameters a save leaves out (``exclude_frozen_parameters``)."""
    if not options.exclude_frozen_parameters:
        return ()
    return tuple(n for n, p in state.module.named_parameters() if not p.requires_grad)


def _rank_files(state: TrainState, options: SaveOptions) -> list[tuple[str, Any, tuple[Any, ...]]]:
    """This rank's shard file (rank 0: also buffers and extras) as ``(name, object, pieces)``, not written."""
    rank = dist.get_rank()
    opt = state.optimizer
    states = [elementwise_state(opt, gi) for gi in range(len(opt.groups))]
    payload: dict[str, Any] = {}
    ranges = []
    skip = set(_excluded(state, options))
    for name, piece in local_pieces(state.module, opt).items():
        if not piece.writes or name in skip:
            continue
        n = piece.stop - piece.start
        entry: dict[str, Any] = {"start": piece.start, "stop": piece.stop, "value": piece.real}
        if piece.optimizer_group is not None:
            gi = piece.optimizer_group
            entry["state"] = {k: v.narrow(0, piece.offset, n) for k, v in states[gi].items()}
        payload[name] = entry
        ranges.append((name, piece.start, piece.stop))
    shard = {"format_version": io.FORMAT_VERSION, "rank": rank, "params": payload, "rng": _rng_state()}
    written = [(io.shard_file_name(rank), shard, tuple(ranges))]
    if rank == 0:
        buffers = {k: v.detach() for k, v in state_dict_buffers(state.module).items()}
        written.append((io.BUFFERS_FILE, {"buffers": buffers}, ()))
        extras = build_extras(state.lr_scheduler, options.client_state, tuple(sorted(skip)))
        written.append((EXTRAS_FILE, extras.payload(), ()))
    return written


def _write_files(
    written: list[tuple[str, Any, tuple[Any, ...]]], tmp: Path, rank: int
) -> list[dict[str, Any]]:
    """Write the files of :func:`_rank_files`; return their manifest entries.

    Raises:
        CheckpointError: an I/O error, naming the file, the rank and the OS error.
    """
    entries = []
    for fname, obj, pieces in written:
        try:
            io.write_torch(obj, tmp / fname)
        except (OSError, RuntimeError) as exc:
            raise hygiene.write_error(tmp / fname, rank, exc) from exc
        size, digest = io.file_digest(tmp / fname)
        entries.append(FileEntry(fname, size, digest, rank, pieces).to_json())
    return entries


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckpointError(
                f"optimizer hyperparameter tensor of shape {tuple(value.shape)} is not saved"
            )
        return value.item()
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, list)):
        return value
    raise CheckpointError(f"optimizer hyperparameter value of type {type(value).__name__} cannot be saved")


def _optimizer_groups(state: TrainState) -> tuple[SavedOptimizerGroup, ...]:
    opt = state.optimizer
    groups = []
    for gi, pg in enumerate(opt.torch_optimizer.param_groups):
        master = opt.groups[gi].master
        saved = opt.torch_optimizer.state.get(master, {})
        element = elementwise_state(opt, gi)
        scalars = {}
        for k, v in saved.items():
            if k in element:
                continue
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    raise CheckpointError(
                        f"optimizer state {k!r} of group {gi} has shape {tuple(v.shape)}: neither per "
                        f"element (shape {tuple(master.shape)}) nor a scalar; this optimizer cannot be saved"
                    )
                scalars[k] = {"tensor": True, "dtype": io.dtype_name(v.dtype), "value": v.item()}
            else:
                scalars[k] = {"tensor": False, "value": _json_value(v)}
        groups.append(
            SavedOptimizerGroup(
                {k: _json_value(v) for k, v in pg.items() if k != "params"},
                scalars,
                {k: io.dtype_name(v.dtype) for k, v in element.items()},
            )
        )
    return tuple(groups)


def build_manifest(
    state: TrainState, tag: str, files: list[FileEntry], skip: tuple[str, ...] = ()
) -> Manifest:
    """The manifest of a checkpoint of ``state`` whose ranks wrote ``files`` (checks every element is saved).

    ``skip``: parameters left out of the save (frozen ones, ``exclude_frozen_parameters``).

    Raises:
        CheckpointError: the pieces of some parameter do not cover it.
    """
    pieces = local_pieces(state.module, state.optimizer)
    covered: dict[str, list[tuple[int, int]]] = {}
    for f in files:
        for name, a, b in f.pieces:
            covered.setdefault(name, []).append((a, b))
    params = []
    for name, p in pieces.items():
        if name in skip:
            continue
        _check_coverage(name, p.numel, covered.get(name, []))
        params.append(
            SavedParam(
                name,
                tuple(p.shape),
                io.dtype_name(p.dtype),
                p.numel,
                p.trainable,
                p.optimizer_group,
                p.partition_numel,
                p.world,
            )
        )
    buffers = state_dict_buffers(state.module)
    counters = state.counters
    return Manifest(
        tag=tag,
        created_unix=time.time(),
        torch_version=torch.__version__,
        world_size=dist.get_world_size(),
        stage=state.config.stage,
        partition_layout=_partition_layout(state),
        global_steps=counters.global_steps,
        micro_steps=counters.micro_steps,
        gradient_accumulation_steps=counters.gradient_accumulation_steps,
        config=state.config.model_dump(mode="json"),
        params=tuple(params),
        buffers=tuple(SavedBuffer(k, tuple(v.shape), io.dtype_name(v.dtype)) for k, v in buffers.items()),
        state_dict_keys=tuple(state_dict_keys(state.module)),
        optimizer_type=type(state.optimizer.torch_optimizer).__name__,
        optimizer_groups=_optimizer_groups(state),
        loss_scaler=state.scaler.state_dict() if state.scaler is not None else None,
        files=tuple(files),
    )


def _partition_layout(state: TrainState) -> dict[str, Any]:
    """How the saved partitions relate to the ranks (informational: loading reads ``params``).

    Under MiCS only the first shard group (ranks ``0 .. shard_size - 1``, the replica 0 of
    every partition) writes parameter pieces: one copy per partition, not ``replicas`` copies.
    """
    mics = state.mics
    if mics is None:
        return {"kind": "zero", "replicas": 1}
    return {
        "kind": "mics",
        "shard_size": mics.shard_size,
        "replicas": mics.replicas,
        "hierarchical_gather": mics.hierarchical,
        "writer_ranks": list(range(mics.shard_size)),
    }


def _check_coverage(name: str, numel: int, ranges: list[tuple[int, int]]) -> None:
    pos = covered_prefix(ranges)
    if pos < numel:
        raise CheckpointError(
            f"the ranks' pieces of parameter {name!r} cover only elements [0, {pos}) of {numel}: "
            "this partitioning cannot be checkpointed"
        )
