"""Sharded, atomic, world-size-independent checkpoints of an :class:`~zero_full.Engine`.

* :func:`save_checkpoint`: every rank writes its own shard file (its pieces of every
  parameter: fp32 master + per-element optimizer state, keyed by parameter name with the
  element range of the flattened parameter they cover, and its RNG states); rank 0 writes
  the buffers and, once every rank reported success, the manifest (see
  :mod:`zero_full.ckpt_io` for the layout). Everything is written into
  ``DIR/TAG.tmp-<random>`` and renamed to ``DIR/TAG`` only when complete; ``DIR/latest``
  moves after that. A save that fails (or dies) on any rank leaves the previous checkpoints
  and ``latest`` untouched and no ``DIR/TAG``. Before writing, the free space is checked
  against the bytes each host's ranks are about to write; an I/O error names the file, the
  rank and the OS error ("disk full" for ENOSPC); temporary directories left by saves that
  did not complete are removed by rank 0 at the next save or load (see
  :mod:`zero_full.ckpt_hygiene`).
* :func:`load_checkpoint`: checks the checkpoint against the model (all mismatches at
  once), then each rank reads only the pieces overlapping its own partition of each
  parameter, whatever world size and stage wrote them, after verifying each file it reads
  against its sha256.
* :func:`consolidated_state_dict`: the full fp32 weights, gathered one parameter at a time.

Distributed waits use explicit timeouts: a rank that dies makes the others raise instead
of hanging.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import random
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

import zero_params
from zero_full import ckpt_hygiene, ckpt_io
from zero_full.ckpt_io import CheckpointError, FileEntry
from zero_full.ckpt_layout import LocalPiece, elementwise_state, local_pieces

if TYPE_CHECKING:
    from zero_full.engine import Engine

__all__ = [
    "DEFAULT_TIMEOUT",
    "CheckpointError",
    "consolidated_state_dict",
    "load_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger("zero.checkpoint")

DEFAULT_TIMEOUT = 1800.0
"""Seconds a rank waits for the others at a checkpoint barrier before raising."""


# ---------------------------------------------------------------------------- collectives


def _exchange(obj: Any, timeout: float) -> list[Any]:
    """All-gather one JSON-able object per rank, waiting at most ``timeout`` seconds per collective."""
    data = json.dumps(obj).encode("utf-8")
    world = dist.get_world_size()
    if world == 1:
        return [obj]
    wait = datetime.timedelta(seconds=timeout)
    device = _control_device()
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    try:
        mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.all_gather_single(sizes, mine, async_op=True).wait(wait)
        sizes = sizes.cpu()
        width = int(sizes.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(world * width, dtype=torch.uint8, device=device)
        dist.all_gather_single(out, mine.to(device), async_op=True).wait(wait)
        out = out.cpu()
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint: rank {dist.get_rank()} gave up waiting for the other ranks ({timeout:g} s "
            f"timeout or a rank died): {exc}"
        ) from exc
    rows = out.view(world, width)
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist()).decode("utf-8")) for r in range(world)]


def _control_device() -> torch.device:
    """Where small control tensors go: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_if_failed(statuses: list[Any], what: str) -> None:
    errors = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
    if errors:
        raise CheckpointError(f"{what} failed:\n  " + "\n  ".join(errors))


# ---------------------------------------------------------------------------- save


@dataclasses.dataclass(frozen=True)
class _SavePlan:
    directory: Path
    tag: str
    tmp: Path


def save_checkpoint(
    engine: Engine, directory: str | Path, tag: str | None = None, *, timeout: float = DEFAULT_TIMEOUT
) -> Path:
    """Write a sharded checkpoint of ``engine`` to ``directory/tag`` (call on every rank).

    Args:
        engine: The engine.
        directory: The checkpoint root (created if missing).
        tag: Sub-directory name; default ``global_step{N}``.
        timeout: Seconds to wait for the other ranks at each barrier.

    Returns:
        The checkpoint directory ``directory/tag``.

    Raises:
        CheckpointError: ``directory/tag`` exists already, or writing failed on some rank
            (every rank raises, naming the failing ranks; nothing is left under ``tag``).
    """
    directory = Path(directory)
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    if "/" in tag or tag in ("", ".", "..", ckpt_io.LATEST) or ".tmp-" in tag:
        raise ValueError(f"checkpoint tag {tag!r} is not a plain directory name; pass e.g. 'step100'")
    rank = dist.get_rank()
    with record_function("zero.checkpoint.save"):
        err = None
        tmp_name = ""
        if rank == 0:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                if (directory / tag).exists():
                    raise CheckpointError(
                        f"checkpoint {directory / tag} exists already; save under another tag or remove it"
                    )
                tmp_name = f"{tag}.tmp-{secrets.token_hex(6)}"
                (directory / tmp_name).mkdir()
            except (OSError, CheckpointError) as exc:
                err = str(exc)
        first = _exchange({"error": err, "tmp": tmp_name}, timeout)
        _raise_if_failed([s["error"] for s in first], f"saving checkpoint {directory / tag}")
        plan = _SavePlan(directory, tag, directory / first[0]["tmp"])
        if rank == 0:  # every rank is in this save: no other save of this job is writing
            ckpt_hygiene.remove_stale(directory, keep=plan.tmp.name)
        try:
            # offloaded optimizer state is read back from host memory / swap files for the save
            with engine.optimizer.materialized_state(write_back=False):
                _save_in_tmp(engine, plan, timeout)
        except BaseException:
            if rank == 0:
                shutil.rmtree(plan.tmp, ignore_errors=True)
            raise
    return directory / tag


def _save_in_tmp(engine: Engine, plan: _SavePlan, timeout: float) -> None:
    rank = dist.get_rank()
    info: dict[str, Any] | None = None
    err = None
    failure: BaseException | None = None
    written: list[tuple[str, Any, tuple[Any, ...]]] = []
    try:
        written = _rank_files(engine)
        need = ckpt_hygiene.tensor_bytes([obj for _, obj, _ in written])
    except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised below
        err, failure, need = f"{type(exc).__name__}: {exc}", exc, 0
    sizes = _exchange({"error": err, "host": socket.gethostname(), "need": need}, timeout)
    if err is None and not any(s["error"] for s in sizes):
        host_need = sum(s["need"] for s in sizes if s["host"] == sizes[rank]["host"])
        try:
            ckpt_hygiene.check_free_space(plan.tmp, host_need, rank, str(plan.directory / plan.tag))
            info = _write_files(written, plan.tmp, rank)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, re-raised below
            err, failure = f"{type(exc).__name__}: {exc}", exc
    del written
    statuses = _exchange({"error": err, "files": info}, timeout)
    try:
        errors = [s["error"] or z["error"] for s, z in zip(statuses, sizes)]
        _raise_if_failed(errors, f"saving checkpoint {plan.directory / plan.tag}")
    except CheckpointError as exc:
        raise exc from failure
    err = None
    if rank == 0:
        try:
            files = [FileEntry.from_json(f) for s in statuses for f in s["files"]]
            manifest = _manifest(engine, plan.tag, files)
            try:
                ckpt_io.write_text_atomic(plan.tmp / ckpt_io.MANIFEST, json.dumps(manifest, indent=1))
            except OSError as exc:
                raise ckpt_hygiene.write_error(plan.tmp / ckpt_io.MANIFEST, rank, exc) from exc
            plan.tmp.rename(plan.directory / plan.tag)
            ckpt_io.fsync_dir(plan.directory)
            ckpt_io.write_text_atomic(plan.directory / ckpt_io.LATEST, plan.tag)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            err = f"{type(exc).__name__}: {exc}"
    done = _exchange(err, timeout)
    _raise_if_failed(done, f"saving checkpoint {plan.directory / plan.tag}")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _rank_files(engine: Engine) -> list[tuple[str, Any, tuple[Any, ...]]]:
    """This rank's shard file (and rank 0's buffers file) as ``(name, object, pieces)``, not written yet."""
    rank = dist.get_rank()
    opt = engine.optimizer
    states = [elementwise_state(opt, gi) for gi in range(len(opt.groups))]
    payload: dict[str, Any] = {}
    ranges = []
    for name, piece in local_pieces(engine.module, opt).items():
        if not piece.writes:
            continue
        n = piece.stop - piece.start
        entry: dict[str, Any] = {"start": piece.start, "stop": piece.stop, "value": piece.real}
        if piece.optimizer_group is not None:
            gi = piece.optimizer_group
            entry["state"] = {k: v.narrow(0, piece.offset, n) for k, v in states[gi].items()}
        payload[name] = entry
        ranges.append((name, piece.start, piece.stop))
    shard = {"format_version": ckpt_io.FORMAT_VERSION, "rank": rank, "params": payload, "rng": _rng_state()}
    written = [(ckpt_io.shard_file_name(rank), shard, tuple(ranges))]
    if rank == 0:
        buffers = {k: v.detach() for k, v in _state_dict_buffers(engine.module).items()}
        written.append((ckpt_io.BUFFERS_FILE, {"buffers": buffers}, ()))
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
            ckpt_io.write_torch(obj, tmp / fname)
        except (OSError, RuntimeError) as exc:
            raise ckpt_hygiene.write_error(tmp / fname, rank, exc) from exc
        size, digest = ckpt_io.file_digest(tmp / fname)
        entries.append(FileEntry(fname, size, digest, rank, pieces).to_json())
    return entries


def _state_dict_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds (persistent ones), keyed like it."""
    params = {id(p) for p in module.parameters()}
    return {
        k: v
        for k, v in module.state_dict(keep_vars=True).items()
        if isinstance(v, torch.Tensor) and id(v) not in params
    }


def _state_dict_keys(module: torch.nn.Module) -> list[dict[str, str]]:
    """``model.state_dict()`` keys in order: parameters (with their canonical name) and buffers."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    keys = []
    for k, v in module.state_dict(keep_vars=True).items():
        if id(v) in canonical:
            keys.append({"key": k, "kind": "param", "source": canonical[id(v)]})
        elif isinstance(v, torch.Tensor):
            keys.append({"key": k, "kind": "buffer", "source": k})
    return keys


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


def _optimizer_manifest(engine: Engine) -> dict[str, Any]:
    opt = engine.optimizer
    groups = []
    for gi, pg in enumerate(opt.torch_optimizer.param_groups):
        master = opt.groups[gi].master
        state = opt.torch_optimizer.state.get(master, {})
        element = elementwise_state(opt, gi)
        scalars = {}
        for k, v in state.items():
            if k in element:
                continue
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    raise CheckpointError(
                        f"optimizer state {k!r} of group {gi} has shape {tuple(v.shape)}: neither per "
                        f"element (shape {tuple(master.shape)}) nor a scalar; this optimizer cannot be saved"
                    )
                scalars[k] = {"tensor": True, "dtype": ckpt_io.dtype_name(v.dtype), "value": v.item()}
            else:
                scalars[k] = {"tensor": False, "value": _json_value(v)}
        groups.append(
            {
                "hyperparameters": {k: _json_value(v) for k, v in pg.items() if k != "params"},
                "scalar_state": scalars,
                "elementwise_state": {k: ckpt_io.dtype_name(v.dtype) for k, v in element.items()},
            }
        )
    return {"type": type(opt.torch_optimizer).__name__, "groups": groups}


def _manifest(engine: Engine, tag: str, files: list[FileEntry]) -> dict[str, Any]:
    pieces = local_pieces(engine.module, engine.optimizer)
    covered: dict[str, list[tuple[int, int]]] = {}
    for f in files:
        for name, a, b in f.pieces:
            covered.setdefault(name, []).append((a, b))
    params = []
    for name, p in pieces.items():
        _check_coverage(name, p.numel, covered.get(name, []))
        params.append(
            {
                "name": name,
                "shape": list(p.shape),
                "dtype": ckpt_io.dtype_name(p.dtype),
                "numel": p.numel,
                "trainable": p.trainable,
                "optimizer_group": p.optimizer_group,
                "partitioning": {"numel": p.numel, "partition_numel": p.partition_numel, "world": p.world},
            }
        )
    buffers = _state_dict_buffers(engine.module)
    scaler = _loss_scaler(engine)
    return {
        "format": ckpt_io.FORMAT_NAME,
        "format_version": ckpt_io.FORMAT_VERSION,
        "tag": tag,
        "created_unix": time.time(),
        "torch_version": torch.__version__,
        "world_size": dist.get_world_size(),
        "stage": engine.config.stage,
        "partition_layout": _partition_layout(engine),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        "config": engine.config.model_dump(mode="json"),
        "params": params,
        "buffers": [
            {"name": k, "shape": list(v.shape), "dtype": ckpt_io.dtype_name(v.dtype)}
            for k, v in buffers.items()
        ],
        "state_dict_keys": _state_dict_keys(engine.module),
        "optimizer": _optimizer_manifest(engine),
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "files": [f.to_json() for f in files],
    }


def _partition_layout(engine: Engine) -> dict[str, Any]:
    """How the saved partitions relate to the ranks (informational: loading reads ``params``).

    Under MiCS only the first shard group (ranks ``0 .. shard_size - 1``, the replica 0 of
    every partition) writes parameter pieces: one copy per partition, not ``replicas`` copies.
    """
    mics = engine.mics
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
    pos = 0
    for a, b in sorted(ranges):
        if a > pos:
            break
        pos = max(pos, b)
    if pos < numel:
        raise CheckpointError(
            f"the ranks' pieces of parameter {name!r} cover only elements [0, {pos}) of {numel}: "
            "this partitioning cannot be checkpointed"
        )


def _loss_scaler(engine: Engine) -> Any:
    """The engine's fp16 loss scaler (``state_dict`` / ``load_state_dict``), or ``None``."""
    return engine.loss_scaler


# ---------------------------------------------------------------------------- load


def load_checkpoint(
    engine: Engine, directory: str | Path, tag: str | None = None, *, timeout: float = DEFAULT_TIMEOUT
) -> Path:
    """Restore ``engine`` from ``directory/tag`` (``tag=None``: the one ``directory/latest`` names).

    Works at any world size and stage: each rank reads the saved pieces overlapping its own
    partition of each parameter. At the world size it was saved at, every rank's RNG states
    are restored too (at another world size they are left alone: per-rank streams do not
    map). Gradients accumulated before the save are not part of a checkpoint.

    Returns:
        The checkpoint directory that was loaded.

    Raises:
        CheckpointError: no such checkpoint; it does not match the model (every missing,
            unexpected or misshaped parameter and buffer listed) or the optimizer; a file is
            missing, truncated or corrupt (named). After a failure while copying, the engine
            is in an undefined state: build a new one.
    """
    directory = Path(directory)
    with record_function("zero.checkpoint.load"):
        tag = ckpt_io.resolve_tag(directory, tag)
        path = directory / tag
        manifest = ckpt_io.read_manifest(path)
        pieces = local_pieces(engine.module, engine.optimizer)
        # offloaded optimizer state: loaded into torch's format, then written to the offload store
        with engine.optimizer.materialized_state():
            _check_matches(manifest, pieces, engine)
            err = None
            try:
                _read_pieces(engine, path, manifest, pieces)
            except (CheckpointError, OSError, RuntimeError, KeyError) as exc:
                err = f"{type(exc).__name__}: {exc}"
            _raise_if_failed(_exchange(err, timeout), f"loading checkpoint {path}")
            if dist.get_rank() == 0:  # every rank is in this load: no save of this job is writing
                ckpt_hygiene.remove_stale(directory)
            _restore_scalars(engine, manifest)
        with torch.no_grad():
            for group in engine.optimizer.groups:
                group.publish()
            engine.optimizer.partitioning.after_step(engine.optimizer.groups)
            frozen = [
                p
                for n, p in engine.module.named_parameters()
                if not pieces[n].trainable and zero_params.is_partitioned(p)
            ]
            if frozen:
                zero_params.commit_shards(frozen)
    logger.info("zero: loaded checkpoint %s (saved at world size %s)", path, manifest["world_size"])
    return path


def _check_matches(manifest: dict[str, Any], pieces: dict[str, LocalPiece], engine: Engine) -> None:
    saved = {p["name"]: p for p in manifest["params"]}
    problems = [f"missing in the checkpoint: parameter {n!r}" for n in pieces if n not in saved]
    problems += [
        f"unexpected in the checkpoint: parameter {n!r} (not in the model)" for n in saved if n not in pieces
    ]
    for name, piece in pieces.items():
        s = saved.get(name)
        if s is None:
            continue
        if tuple(s["shape"]) != piece.shape:
            problems.append(
                f"shape mismatch: parameter {name!r} is {list(piece.shape)} here, {s['shape']} saved"
            )
        elif s["trainable"] != piece.trainable:
            problems.append(
                f"parameter {name!r} is {'' if piece.trainable else 'not '}trainable here, "
                "not in the checkpoint"
            )
        elif s["optimizer_group"] != piece.optimizer_group:
            problems.append(
                f"parameter {name!r} is in optimizer group {piece.optimizer_group} here, "
                f"{s['optimizer_group']} saved"
            )
    here_buffers = {k: tuple(v.shape) for k, v in _state_dict_buffers(engine.module).items()}
    saved_buffers = {b["name"]: tuple(b["shape"]) for b in manifest["buffers"]}
    problems += [f"missing in the checkpoint: buffer {n!r}" for n in here_buffers if n not in saved_buffers]
    problems += [
        f"unexpected in the checkpoint: buffer {n!r}" for n in saved_buffers if n not in here_buffers
    ]
    problems += [
        f"shape mismatch: buffer {n!r} is {list(s)} here, {list(saved_buffers[n])} saved"
        for n, s in here_buffers.items()
        if n in saved_buffers and saved_buffers[n] != s
    ]
    opt = manifest["optimizer"]
    here_type = type(engine.optimizer.torch_optimizer).__name__
    if opt["type"] != here_type:
        problems.append(f"optimizer type: {here_type} here, {opt['type']} saved")
    if len(opt["groups"]) != len(engine.optimizer.groups):
        problems.append(f"optimizer groups: {len(engine.optimizer.groups)} here, {len(opt['groups'])} saved")
    if problems:
        raise CheckpointError(
            f"checkpoint {manifest['tag']!r} does not match the model ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems)
        )


def _read_pieces(engine: Engine, path: Path, manifest: dict[str, Any], pieces: dict[str, LocalPiece]) -> None:
    """Verify and read every file holding a piece this rank needs; copy the overlaps in place."""
    files = ckpt_io.manifest_files(manifest)
    needs = plan_reads(files, {n: (p.start, p.stop) for n, p in pieces.items()})
    same_world = manifest["world_size"] == dist.get_world_size()
    own = ckpt_io.shard_file_name(dist.get_rank())
    by_name = {f.name: f for f in files}
    wanted = set(needs) | {ckpt_io.BUFFERS_FILE} | ({own} if same_world else set())
    for name in sorted(wanted):
        ckpt_io.verify_file(path / name, by_name[name])
    states = _prepare_optimizer_state(engine, manifest)
    with torch.no_grad():
        for p in pieces.values():
            if p.trainable:
                p.padded.zero_()
                for t in states[p.optimizer_group].values():
                    t.narrow(0, p.offset, p.partition_numel).zero_()
        for fname, items in sorted(needs.items()):
            shard = ckpt_io.open_shard(path / fname)["params"]
            for name, a, b in items:
                p = pieces[name]
                lo, hi = max(a, p.start), min(b, p.stop)
                saved = shard[name]
                p.padded.narrow(0, lo - p.start, hi - lo).copy_(saved["value"].narrow(0, lo - a, hi - lo))
                if p.trainable:
                    gstate = states[p.optimizer_group]
                    for key, t in gstate.items():
                        src = saved["state"].get(key)
                        if src is None:
                            raise CheckpointError(
                                f"{path / fname}: parameter {name!r} has no optimizer state {key!r}"
                            )
                        t.narrow(0, p.offset + lo - p.start, hi - lo).copy_(src.narrow(0, lo - a, hi - lo))
            del shard
        buffers = ckpt_io.open_shard(path / ckpt_io.BUFFERS_FILE)["buffers"]
        for key, t in _state_dict_buffers(engine.module).items():
            t.copy_(buffers[key])
        if same_world:
            _set_rng_state(ckpt_io.open_shard(path / own)["rng"])


def plan_reads(
    files: list[FileEntry], wanted: dict[str, tuple[int, int]]
) -> dict[str, list[tuple[str, int, int]]]:
    """Which saved pieces a rank must read: per file, the ``(name, start, stop)`` pieces that
    overlap the element range ``wanted[name]`` this rank holds now (files with none are absent).
    """
    needs: dict[str, list[tuple[str, int, int]]] = {}
    for f in files:
        for name, a, b in f.pieces:
            lo, hi = wanted[name]
            if max(a, lo) < min(b, hi):
                needs.setdefault(f.name, []).append((name, a, b))
    return needs


def _prepare_optimizer_state(engine: Engine, manifest: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Each group's per-element state tensors, created (zeros) where the optimizer has none yet."""
    opt = engine.optimizer
    out = []
    for gi, saved in enumerate(manifest["optimizer"]["groups"]):
        master = opt.groups[gi].master
        state = opt.torch_optimizer.state[master]
        have = elementwise_state(opt, gi)
        if have and set(have) != set(saved["elementwise_state"]):
            raise CheckpointError(
                f"optimizer group {gi}: state {sorted(have)} here, {sorted(saved['elementwise_state'])} saved"
            )
        for key, dtype in saved["elementwise_state"].items():
            if key not in state:
                state[key] = torch.zeros_like(master, dtype=ckpt_io.dtype_from_name(dtype))
        out.append({k: state[k] for k in saved["elementwise_state"]})
    return out


def _restore_scalars(engine: Engine, manifest: dict[str, Any]) -> None:
    opt = engine.optimizer
    for gi, saved in enumerate(manifest["optimizer"]["groups"]):
        pg = opt.torch_optimizer.param_groups[gi]
        for key, value in saved["hyperparameters"].items():
            if key in pg:
                current = pg[key]
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                else:
                    pg[key] = tuple(value) if isinstance(current, tuple) else value
        master = opt.groups[gi].master
        state = opt.torch_optimizer.state[master]
        on_device = bool(pg.get("capturable") or pg.get("fused"))
        for key, s in saved["scalar_state"].items():
            if s["tensor"]:
                device = master.device if on_device else torch.device("cpu")
                state[key] = torch.tensor(
                    s["value"], dtype=ckpt_io.dtype_from_name(s["dtype"]), device=device
                )
            else:
                state[key] = s["value"]
    engine.global_steps = int(manifest["global_steps"])
    if manifest["gradient_accumulation_steps"] == engine.gradient_accumulation_steps:
        engine.micro_steps = int(manifest["micro_steps"])
    else:
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps
    scaler = _loss_scaler(engine)
    if scaler is not None and manifest["loss_scaler"] is not None:
        scaler.load_state_dict(manifest["loss_scaler"])


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


# ---------------------------------------------------------------------------- consolidate


def _gather_full(piece: LocalPiece) -> torch.Tensor:
    """The whole flattened parameter (fp32 when floating) on every rank of its group."""
    if piece.world == 1:
        full = piece.padded.narrow(0, 0, piece.numel)
    else:
        out = torch.empty(
            piece.world * piece.partition_numel, dtype=piece.padded.dtype, device=piece.padded.device
        )
        dist.all_gather_single(out, piece.padded.contiguous(), group=piece.group)
        full = out.narrow(0, 0, piece.numel)
    if full.is_floating_point():
        full = full.float()
    return full.view(piece.shape)


def iter_consolidated(engine: Engine) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of ``model.state_dict()``, one parameter gathered at a time (every rank).

    Tensors are yielded on rank 0 only (CPU, fp32 for floating-point parameters, buffers in
    their dtype); tied parameters are yielded under each of their keys (gathered once per key).
    """
    pieces = local_pieces(engine.module, engine.optimizer)
    buffers = _state_dict_buffers(engine.module)
    is_root = dist.get_rank() == 0
    with torch.no_grad():
        for entry in _state_dict_keys(engine.module):
            if entry["kind"] == "param":
                full = _gather_full(pieces[entry["source"]])
            else:
                full = buffers[entry["source"]].detach()
            if is_root:
                yield entry["key"], full.detach().to("cpu", copy=True)


def consolidated_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """Full fp32 weights keyed like ``model.state_dict()`` (buffers included), on rank 0.

    Collective: call on every rank. Parameters are gathered one at a time (peak extra
    memory: one full parameter). Rank 0 gets CPU tensors loadable by
    ``model.load_state_dict`` on an unsharded model; the other ranks get ``{}``.
    Tied parameters share one tensor under each key.
    """
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    canonical = {e["key"]: e["source"] for e in _state_dict_keys(engine.module) if e["kind"] == "param"}
    with record_function("zero.checkpoint.consolidate"):
        for key, tensor in iter_consolidated(engine):
            src = canonical.get(key)
            if src is not None and src in seen:
                out[key] = seen[src]
                continue
            out[key] = tensor
            if src is not None:
                seen[src] = tensor
    return out
