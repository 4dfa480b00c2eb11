"""Restoring a checkpoint at any world size and stage: :func:`load_checkpoint`."""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

import zero_params
from zero_full.checkpoint import hygiene, io, safety
from zero_full.checkpoint.collectives import exchange, raise_if_failed
from zero_full.checkpoint.consolidate import state_dict_buffers
from zero_full.checkpoint.extras import Extras, read_extras
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.layout import LocalPiece, elementwise_state, local_pieces
from zero_full.checkpoint.manifest import FileEntry, Manifest
from zero_full.checkpoint.state import TrainState

__all__ = ["LoadOptions", "commit_loaded", "load_checkpoint", "plan_reads"]

logger = logging.getLogger("zero.checkpoint")


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What a load restores."""

    strict: bool = True
    optimizer_states: bool = True
    lr_scheduler_states: bool = True
    module_only: bool = False

    @property
    def full(self) -> bool:
        """Whether the optimizer state (with the loss scaler and RNG states) is restored."""
        return self.optimizer_states and not self.module_only


def load_checkpoint(
    state: TrainState,
    directory: str | Path,
    tag: str | None = None,
    *,
    timeout: float | None = None,
    options: LoadOptions | None = None,
) -> Path:
    """Restore ``state`` from ``directory/tag`` (``tag=None``: the one ``directory/latest`` names).

    Works at any world size and stage: each rank reads the saved pieces overlapping its own
    partition of each parameter. At the world size it was saved at, every rank's RNG states
    are restored too (at another world size they are left alone: per-rank streams do not
    map). Gradients accumulated before the save are not part of a checkpoint.
    """
    directory = Path(directory)
    options = options if options is not None else LoadOptions()
    wait = state.timeout if timeout is None else timeout
    with record_function("zero.checkpoint.load"):
        path = directory / _agreed_tag(directory, tag, wait)
        manifest, extras, loaded, err = None, None, [], None
        pieces = local_pieces(state.module, state.optimizer)
        try:
            manifest = Manifest.read(path)
            extras = read_extras(path, manifest)
            loaded = _check_matches(manifest, pieces, state, options, extras)
        except CheckpointError as exc:
            err = str(exc)
        raise_if_failed(exchange(err, wait), f"loading checkpoint {path}")
        if manifest is None or extras is None:  # unreachable: this rank reported its error, every rank raised
            raise CheckpointError(f"{path / io.MANIFEST} could not be read")
        # offloaded optimizer state: loaded into torch's format, then written to the offload store
        with state.optimizer.materialized_state():
            err = None
            try:
                _read_pieces(state, path, manifest, {n: pieces[n] for n in loaded}, options)
            except Exception as exc:  # noqa: BLE001 - reported on every rank (names the file)
                err = f"{type(exc).__name__}: {exc}"
            raise_if_failed(exchange(err, wait), f"loading checkpoint {path}")
            if dist.get_rank() == 0:  # every rank is in this load: no save of this job is writing
                hygiene.remove_stale(directory)
            if options.full:
                _restore_scalars(state, manifest)
            if not options.module_only:
                state.counters.restore(
                    manifest.global_steps, manifest.micro_steps, manifest.gradient_accumulation_steps
                )
            if options.lr_scheduler_states and not options.module_only:
                _restore_scheduler(state, extras, path)
        commit_loaded(state, pieces)
    logger.info("zero: loaded checkpoint %s (saved at world size %s)", path, manifest.world_size)
    return path


def _agreed_tag(directory: Path, tag: str | None, wait: float) -> str:
    """The tag every rank loads: resolved once, by rank 0 (``latest`` is read once), and agreed.

    Raises:
        CheckpointError: on every rank: the ranks asked for different tags, or rank 0 could not
            resolve it (no ``latest``, an invalid tag, one outside the root), or a rank does not
            see the checkpoint directory.
    """
    resolved, err = None, None
    if dist.get_rank() == 0:
        try:
            resolved = safety.resolve_tag(directory, tag)
        except CheckpointError as exc:
            err = str(exc)
    first = exchange({"asked": tag, "resolved": resolved, "error": err}, wait)
    asked = [s["asked"] for s in first]
    if len(set(asked)) > 1:
        named = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(asked))
        raise CheckpointError(
            f"load_checkpoint: the ranks asked for different tags ({named}); pass the same tag on "
            "every rank, or None on every rank (the tag 'latest' names, read once on rank 0)"
        )
    raise_if_failed([first[0]["error"]], f"loading checkpoint from {directory}")
    agreed = str(first[0]["resolved"])
    missing = None if (directory / agreed).is_dir() else f"{directory / agreed} is not visible on this rank"
    raise_if_failed(exchange(missing, wait), f"loading checkpoint {directory / agreed}")
    return agreed


def commit_loaded(state: TrainState, pieces: dict[str, LocalPiece]) -> None:
    """Publish loaded pieces: the optimizer's masters to the working weights, frozen shards to
    their homes (an offloaded one's copy written back) and to the gathered parameters."""
    state.optimizer.publish_updated_shards()
    frozen = [
        p
        for n, p in state.module.named_parameters()
        if not pieces[n].trainable and zero_params.is_partitioned(p)
    ]
    if frozen:
        with torch.no_grad():
            for n, p in state.module.named_parameters():
                home = zero_params.state_of(p).offload if zero_params.is_partitioned(p) else None
                if home is not None and not pieces[n].trainable:  # the copy _frozen_values made
                    home.replace(zero_params.state_of(p), pieces[n].padded)
            zero_params.commit_shards(frozen)


def _check_matches(
    manifest: Manifest,
    pieces: dict[str, LocalPiece],
    state: TrainState,
    options: LoadOptions,
    extras: Extras,
) -> list[str]:
    """Every mismatch of the checkpoint against the model at once; returns the parameters to load.

    Frozen parameters the save left out (``exclude_frozen_parameters``) and, without
    ``strict``, missing or unexpected names are not mismatches (missing ones are not loaded).
    """
    saved = {p.name: p for p in manifest.params}
    excluded = set(extras.excluded_frozen)
    missing = [n for n in pieces if n not in saved and not (n in excluded and not pieces[n].trainable)]
    problems: list[str] = []
    if options.strict:
        problems += [f"missing in the checkpoint: parameter {n!r}" for n in missing]
        problems += [
            f"unexpected in the checkpoint: parameter {n!r} (not in the model)"
            for n in saved
            if n not in pieces
        ]
    for name, piece in pieces.items():
        s = saved.get(name)
        if s is None:
            continue
        if s.shape != piece.shape:
            problems.append(
                f"shape mismatch: parameter {name!r} is {list(piece.shape)} here, {list(s.shape)} saved"
            )
        elif s.trainable != piece.trainable:
            problems.append(
                f"parameter {name!r} is {'' if piece.trainable else 'not '}trainable here, "
                "not in the checkpoint"
            )
        elif s.optimizer_group != piece.optimizer_group:
            problems.append(
                f"parameter {name!r} is in optimizer group {piece.optimizer_group} here, "
                f"{s.optimizer_group} saved"
            )
    problems += _buffer_problems(manifest, state, options.strict)
    here_type = type(state.optimizer.torch_optimizer).__name__
    if options.full and manifest.optimizer_type != here_type:
        problems.append(f"optimizer type: {here_type} here, {manifest.optimizer_type} saved")
    if options.full and len(manifest.optimizer_groups) != len(state.optimizer.groups):
        problems.append(
            f"optimizer groups: {len(state.optimizer.groups)} here, {len(manifest.optimizer_groups)} saved"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint {manifest.tag!r} does not match the model ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems)
            + "\nNothing was loaded."
        )
    return [n for n in pieces if n in saved]


def _buffer_problems(manifest: Manifest, state: TrainState, strict: bool) -> list[str]:
    here = {k: tuple(v.shape) for k, v in state_dict_buffers(state.module).items()}
    saved = {b.name: b.shape for b in manifest.buffers}
    problems = []
    if strict:
        problems += [f"missing in the checkpoint: buffer {n!r}" for n in here if n not in saved]
        problems += [f"unexpected in the checkpoint: buffer {n!r}" for n in saved if n not in here]
    problems += [
        f"shape mismatch: buffer {n!r} is {list(s)} here, {list(saved[n])} saved"
        for n, s in here.items()
        if n in saved and saved[n] != s
    ]
    return problems


def _read_pieces(
    state: TrainState, path: Path, manifest: Manifest, pieces: dict[str, LocalPiece], options: LoadOptions
) -> None:
    """Verify and read every file holding a piece this rank needs; copy the overlaps in place.

    Without the optimizer state (``options``), only the weights are copied: the state tensors
    are neither zeroed nor read.
    """
    files = list(manifest.files)
    needs = plan_reads(files, {n: (p.start, p.stop) for n, p in pieces.items()})
    same_world = manifest.world_size == dist.get_world_size() and options.full
    own = io.shard_file_name(dist.get_rank())
    by_name = {f.name: f for f in files}
    wanted = set(needs) | {io.BUFFERS_FILE} | ({own} if same_world else set())
    for name in sorted(wanted):
        if name not in by_name:
            raise CheckpointError(f"{path / io.MANIFEST} lists no file {name!r}")
        io.verify_file(safety.inside(path, name, f"{path / io.MANIFEST}"), by_name[name])
    states = _prepare_optimizer_state(state, manifest) if options.full else None
    with torch.no_grad():
        for p in pieces.values():
            if p.trainable:
                p.padded.zero_()
                for t in states[p.optimizer_group].values() if states is not None else ():
                    t.narrow(0, p.offset, p.partition_numel).zero_()
        for fname, items in sorted(needs.items()):
            shard = io.open_shard(path / fname)["params"]
            for name, a, b in items:
                _copy_overlap(pieces[name], shard[name], a, b, states, f"{path / fname}")
            del shard
        buffers = io.open_shard(path / io.BUFFERS_FILE)["buffers"]
        for key, t in state_dict_buffers(state.module).items():
            if key in buffers:  # absent only without strict (checked before)
                t.copy_(buffers[key])
        if same_world:
            _set_rng_state(io.open_shard(path / own)["rng"])


def _copy_overlap(
    p: LocalPiece,
    saved: dict[str, Any],
    a: int,
    b: int,
    states: list[dict[str, torch.Tensor]] | None,
    where: str,
) -> None:
    """Copy the saved piece ``[a, b)`` of one parameter where it overlaps this rank's piece.

    ``states`` ``None``: the weights only (the optimizer state is not loaded).
    """
    lo, hi = max(a, p.start), min(b, p.stop)
    p.padded.narrow(0, lo - p.start, hi - lo).copy_(saved["value"].narrow(0, lo - a, hi - lo))
    if not p.trainable or states is None:
        return
    for key, t in states[p.optimizer_group].items():
        src = saved["state"].get(key)
        if src is None:
            raise CheckpointError(f"{where}: parameter {p.name!r} has no optimizer state {key!r}")
        t.narrow(0, p.offset + lo - p.start, hi - lo).copy_(src.narrow(0, lo - a, hi - lo))


def plan_reads(
    files: list[FileEntry], wanted: dict[str, tuple[int, int]]
) -> dict[str, list[tuple[str, int, int]]]:
    """Which saved pieces a rank must read: per file, the ``(name, start, stop)`` pieces that
    overlap the element range ``wanted[name]`` this rank holds now (files with none are absent;
    saved parameters not in ``wanted`` are not read).
    """
    needs: dict[str, list[tuple[str, int, int]]] = {}
    for f in files:
        for name, a, b in f.pieces:
            if name not in wanted:  # not loaded (strict=False)
                continue
            lo, hi = wanted[name]
            if max(a, lo) < min(b, hi):
                needs.setdefault(f.name, []).append((name, a, b))
    return needs


def _prepare_optimizer_state(state: TrainState, manifest: Manifest) -> list[dict[str, torch.Tensor]]:
    """Each group's per-element state tensors, created (zeros) where the optimizer has none yet."""
    opt = state.optimizer
    out = []
    for gi, saved in enumerate(manifest.optimizer_groups):
        master = opt.groups[gi].master
        ostate = opt.torch_optimizer.state[master]
        have = elementwise_state(opt, gi)
        if have and set(have) != set(saved.elementwise_state):
            raise CheckpointError(
                f"optimizer group {gi}: state {sorted(have)} here, {sorted(saved.elementwise_state)} saved"
            )
        for key, dtype in saved.elementwise_state.items():
            if key not in ostate:
                ostate[key] = torch.zeros_like(master, dtype=io.dtype_from_name(dtype))
        out.append({k: ostate[k] for k in saved.elementwise_state})
    return out


def _restore_scalars(state: TrainState, manifest: Manifest) -> None:
    opt = state.optimizer
    for gi, saved in enumerate(manifest.optimizer_groups):
        pg = opt.torch_optimizer.param_groups[gi]
        for key, value in saved.hyperparameters.items():
            if key in pg:
                current = pg[key]
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                else:
                    pg[key] = tuple(value) if isinstance(current, tuple) else value
        master = opt.groups[gi].master
        ostate = opt.torch_optimizer.state[master]
        on_device = bool(pg.get("capturable") or pg.get("fused"))
        for key, s in saved.scalar_state.items():
            if s["tensor"]:
                device = master.device if on_device else torch.device("cpu")
                ostate[key] = torch.tensor(s["value"], dtype=io.dtype_from_name(s["dtype"]), device=device)
            else:
                ostate[key] = s["value"]
    if state.scaler is not None and manifest.loss_scaler is not None:
        state.scaler.load_state_dict(manifest.loss_scaler)


def _restore_scheduler(state: TrainState, extras: Extras, path: Path) -> None:
    """Load the saved LR scheduler state into ``state.lr_scheduler`` (when both exist)."""
    if state.lr_scheduler is None or extras.lr_scheduler is None:
        return
    try:
        state.lr_scheduler.load_state_dict(extras.lr_scheduler)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: the saved LR scheduler state does not fit {type(state.lr_scheduler).__name__}: {exc}"
        ) from exc


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch_cpu"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["torch_cuda"])
