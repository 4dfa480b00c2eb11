"""Reading a checkpoint that DeepSpeed wrote (ZeRO stages 1, 2 and 3) into a zero run."""

from __future__ import annotations

import dataclasses
import logging
import math
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from zero_full.checkpoint import io, safety
from zero_full.checkpoint.collectives import exchange, raise_if_failed
from zero_full.checkpoint.consolidate import state_dict_buffers
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.layout import LocalPiece, elementwise_state, local_pieces
from zero_full.checkpoint.load import commit_loaded
from zero_full.checkpoint.state import TrainState

__all__ = ["DeepSpeedLayout", "is_deepspeed_checkpoint", "load_deepspeed_checkpoint", "safe_load"]

logger = logging.getLogger("zero.checkpoint")

_MODEL_12 = "mp_rank_00_model_states.pt"
_MODEL_3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class _Inert:
    """A DeepSpeed object read as plain data: its constructor arguments and pickled state.

    Nothing of it runs: the unpickler stores what the file holds and the reader ignores it
    (the fp32 partitions and the torch optimizer state are plain tensors and dicts).
    """

    def __new__(cls, *args: Any) -> _Inert:
        inst = super().__new__(cls)
        inst.args = args
        return inst

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


# The globals of DeepSpeed 0.19.x checkpoint files, each read as an inert record.
_DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.config.DeepSpeedConfig",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
# Plain Python and torch globals they also need (data only).
_PLAIN_GLOBALS: tuple[Any, ...] = ()


def safe_load(path: Path) -> dict[str, Any]:
    """Load one DeepSpeed file without running pickled code (memory-mapped, CPU).

    Raises:
        CheckpointError: the file is missing, not a torch file, or its pickle needs a global
            outside the allow-list (names the file and the global).
    """
    allowed = [(_Inert, name) for name in _DEEPSPEED_GLOBALS] + list(_PLAIN_GLOBALS)
    try:
        with torch.serialization.safe_globals(allowed):
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)|unrecognized function (\S+)|got (<[^>]+>)", str(exc))
        culprit = next((g for g in found.groups() if g), "?") if found else "?"
        raise CheckpointError(
            f"refusing DeepSpeed checkpoint file {path}: its pickle needs {culprit}, which is not "
            "one of the data-only globals a DeepSpeed checkpoint holds (loading it could run code)"
        ) from None
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {exc}") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} holds a {type(obj).__name__}, not a dict")
    return obj


def is_deepspeed_checkpoint(directory: str | Path, tag: str | None = None) -> bool:
    """Whether ``directory/tag`` (``tag=None``: the one ``directory/latest`` names) was written by
    DeepSpeed: it holds DeepSpeed's model-states files and no zero manifest."""
    directory = Path(directory)
    if tag is None:
        latest = directory / io.LATEST
        if not latest.is_file():
            return False
        tag = latest.read_text(encoding="utf-8").strip()
    path = directory / tag
    if not path.is_dir() or (path / io.MANIFEST).exists():
        return False
    return any(p.name == _MODEL_12 or _MODEL_3.match(p.name) for p in path.iterdir())


@dataclasses.dataclass(frozen=True)
class Fragment:
    """The elements ``[start, stop)`` of one parameter held by rank ``rank``'s files, at element
    ``offset`` of that rank's flat partition of optimizer group ``group`` (frozen: of its value)."""

    rank: int
    group: int | None
    offset: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class DeepSpeedLayout:
    """Where every parameter of a DeepSpeed checkpoint lies in its files."""

    path: Path
    stage: int
    world: int
    groups: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    paddings: tuple[tuple[int, ...], ...]
    frozen: dict[str, tuple[int, ...]]
    model_files: tuple[str, ...]
    optim_files: tuple[str, ...]
    global_steps: int

    def group_numel(self, g: int) -> int:
        """Real elements of group ``g``'s flat vector (stages 1 / 2: paddings included)."""
        return sum(math.prod(s) + pad for (_, s), pad in zip(self.groups[g], self.paddings[g], strict=True))

    def partition_numel(self, g: int) -> int:
        """Elements of each rank's partition of group ``g`` at stages 1 / 2 (padding included)."""
        align = 2 * self.world
        return align * math.ceil(self.group_numel(g) / align) // self.world

    def fragments(self) -> dict[str, list[Fragment]]:
        """Every trainable parameter's pieces, by rank, in the files' coordinates."""
        out: dict[str, list[Fragment]] = {}
        for g, params in enumerate(self.groups):
            pos = 0
            part = self.partition_numel(g) if self.stage < 3 else 0
            for (name, shape), pad in zip(params, self.paddings[g], strict=True):
                numel = math.prod(shape)
                frags = out.setdefault(name, [])
                for r in range(self.world):
                    if self.stage < 3:
                        lo, hi = max(pos, r * part), min(pos + numel, (r + 1) * part)
                        if lo < hi:
                            frags.append(Fragment(r, g, lo - r * part, lo - pos, hi - pos))
                    else:
                        each = math.ceil(numel / self.world)
                        lo, hi = min(r * each, numel), min((r + 1) * each, numel)
                        if lo < hi:
                            frags.append(Fragment(r, g, pos, lo, hi))
                pos += numel + pad if self.stage < 3 else math.ceil(numel / self.world)
        return out


def _files(path: Path) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """``(stage-3 or not, model files, optim files)`` of a tag directory, checked for completeness.

    Raises:
        CheckpointError: a rank's file is missing, or a file DeepSpeed does not write is there.
    """
    names = sorted(p.name for p in path.iterdir())
    optim = {int(m.group(2)): n for n in names if (m := _OPTIM.match(n))}
    model3 = {int(m.group(1)): n for n in names if (m := _MODEL_3.match(n))}
    world = max([*optim, *model3], default=-1) + 1
    if world == 0:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path}: no *_optim_states.pt file (a ZeRO checkpoint has one per rank)"
        )
    prefix = _OPTIM.match(optim[min(optim)]).group(1) or "" if optim else ""
    model_files = (
        tuple(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world))
        if model3
        else (_MODEL_12,)
    )
    optim_files = tuple(f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world))
    expected = set(model_files) | set(optim_files)
    missing = sorted(expected - set(names))
    if missing:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} is incomplete: missing {', '.join(missing)} (a checkpoint "
            f"of {world} ranks has {len(expected)} files)"
        )
    extra = sorted(set(names) - expected)
    if extra:
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} holds unexpected file(s) {', '.join(extra)}: not part of a "
            f"ZeRO checkpoint of {world} ranks without tensor or pipeline parallelism"
        )
    return world, model_files, optim_files


def read_layout(path: Path, model: dict[str, Any], optim0: dict[str, Any]) -> DeepSpeedLayout:
    """The layout of ``path`` from its (first) model-states file and rank 0's optimizer states."""
    world, model_files, optim_files = _files(path)
    osd = optim0.get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise CheckpointError(f"{path / optim_files[0]}: no optimizer_state_dict (not a ZeRO checkpoint)")
    zero_stage = osd.get("zero_stage")
    stage = int(zero_stage.args[0]) if isinstance(zero_stage, _Inert) and zero_stage.args else 0
    if stage not in (1, 2, 3) or (stage == 3) != ("fp32_flat_groups" in osd):
        raise CheckpointError(f"{path / optim_files[0]}: not a ZeRO stage 1, 2 or 3 checkpoint")
    if int(model.get("mp_world_size", 1)) != 1:
        raise CheckpointError(
            f"{path / model_files[0]}: written with tensor parallelism, which zero does not read"
        )
    saved_world = int(model.get("dp_world_size", world))
    if saved_world > world:  # the last ranks' files are gone: name them
        prefix = optim_files[0][: -len("zero_pp_rank_0_mp_rank_00_optim_states.pt")]
        gone = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world, saved_world)]
        raise CheckpointError(
            f"DeepSpeed checkpoint {path} is incomplete: missing {', '.join(gone)} "
            f"({path / model_files[0]} was written by {saved_world} data-parallel ranks)"
        )
    if saved_world != world:
        raise CheckpointError(
            f"{path / model_files[0]}: says {model.get('dp_world_size')} data-parallel ranks, "
            f"the directory holds files of {world}"
        )
    shapes = model.get("param_shapes")
    if not isinstance(shapes, list):
        raise CheckpointError(f"{path / model_files[0]}: no param_shapes")
    groups = tuple(tuple((str(n), tuple(int(d) for d in s)) for n, s in g.items()) for g in shapes)
    raw_pads = osd.get("param_alignment_paddings") if stage < 3 else None
    paddings = tuple(
        tuple(int(p) for p in raw_pads[g]) if raw_pads else (0,) * len(params)
        for g, params in enumerate(groups)
    )
    frozen = {str(n): tuple(int(d) for d in s) for n, s in (model.get("frozen_param_shapes") or {}).items()}
    if stage < 3 and not frozen:  # stage 1 lists no frozen parameters: the module's other entries
        trained = {n for g in groups for n, _ in g}
        skip = trained | set(model.get("buffer_names") or ()) | set(model.get("shared_params") or {})
        frozen = {n: tuple(t.shape) for n, t in (model.get("module") or {}).items() if n not in skip}
    return DeepSpeedLayout(
        path,
        stage,
        world,
        groups,
        paddings,
        frozen,
        model_files,
        optim_files,
        int(model.get("global_steps", 0)),
    )


@dataclasses.dataclass(frozen=True)
class RankState:
    """One rank's optimizer-states file: per group, its fp32 partition and element-wise state
    (each a list of flat tensors read as one concatenation), scalar state and hyperparameters."""

    weights: list[list[torch.Tensor]]
    state: list[dict[str, list[torch.Tensor]]]
    scalars: list[dict[str, Any]]
    hyper: list[dict[str, Any]]


def read_rank(layout: DeepSpeedLayout, rank: int, optim: dict[str, Any]) -> RankState:
    """Rank ``rank``'s partitions and optimizer state out of its optimizer-states file."""
    where = layout.path / layout.optim_files[rank]
    osd = optim["optimizer_state_dict"]
    if layout.stage < 3:
        flats = [[t] for t in osd["single_partition_of_fp32_groups"]]
        base = osd["base_optimizer_state"]
        if isinstance(base, list):  # elastic_checkpoint: per group, unpadded, step aside
            per_group = [dict(s) for s in base]
            step = osd.get("base_optimizer_state_step")
            for s in per_group:
                if step is not None:
                    s.setdefault("step", step)
            hyper: list[dict[str, Any]] = [{} for _ in per_group]
        else:
            per_group = [base["state"].get(pg["params"][0], {}) for pg in base["param_groups"]]
            hyper = [dict(pg) for pg in base["param_groups"]]
        states = [[s] for s in per_group]
    else:
        base = osd["optimizer_state_dict"]
        subs = osd["fp32_flat_groups"]
        flats = [[subs[i] for i in pg["params"]] for pg in base["param_groups"]]
        states = [[base["state"].get(i, {}) for i in pg["params"]] for pg in base["param_groups"]]
        hyper = [dict(pg) for pg in base["param_groups"]]
    if len(flats) != len(layout.groups):
        raise CheckpointError(
            f"{where}: {len(flats)} optimizer groups, the model states list {len(layout.groups)}"
        )
    elementwise: list[dict[str, list[torch.Tensor]]] = []
    scalars: list[dict[str, Any]] = []
    for g, subs_state in enumerate(states):
        keys = {k for s in subs_state for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() == 1}
        elementwise.append({k: [s[k] for s in subs_state] for k in sorted(keys)})
        scalars.append({k: v for k, v in subs_state[0].items() if k not in keys} if subs_state else {})
        if layout.stage < 3:
            part = layout.partition_numel(g)
            real = max(0, min(part, layout.group_numel(g) - rank * part))
            if sum(t.numel() for t in flats[g]) < real:
                raise CheckpointError(
                    f"{where}: group {g} partition has {sum(t.numel() for t in flats[g])} elements, "
                    f"expected {real} (the model states do not describe this file)"
                )
    for h in hyper:
        h.pop("params", None)
    return RankState(flats, elementwise, scalars, hyper)


def _take(tensors: list[torch.Tensor], offset: int, length: int) -> torch.Tensor:
    """Elements ``[offset, offset + length)`` of the concatenation of ``tensors``."""
    parts = []
    for t in tensors:
        n = t.numel()
        if offset < n and length > 0:
            k = min(length, n - offset)
            parts.append(t.reshape(-1).narrow(0, offset, k))
            length -= k
            offset = 0
        else:
            offset -= n
    if length > 0:
        raise CheckpointError(f"a DeepSpeed partition is {length} element(s) shorter than its layout says")
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_matches(layout: DeepSpeedLayout, pieces: dict[str, LocalPiece], state: TrainState) -> None:
    """Every mismatch between the checkpoint and the model, raised at once."""
    saved = {n: (g, s) for g, params in enumerate(layout.groups) for n, s in params}
    saved_all = {**{n: (None, s) for n, s in layout.frozen.items()}, **saved}
    problems = [f"missing in the checkpoint: parameter {n!r}" for n in pieces if n not in saved_all]
    problems += [
        f"unexpected in the checkpoint: parameter {n!r} (not in the model)"
        for n in saved_all
        if n not in pieces
    ]
    for name, piece in pieces.items():
        if name not in saved_all:
            continue
        group, shape = saved_all[name]
        if shape != piece.shape:
            problems.append(
                f"shape mismatch: parameter {name!r} is {list(piece.shape)} here, {list(shape)} saved"
            )
        elif group != piece.optimizer_group:
            problems.append(
                f"parameter {name!r} is in optimizer group {piece.optimizer_group} here, {group} saved"
                " (None: frozen)"
            )
    if len(layout.groups) != len(state.optimizer.groups):
        problems.append(f"optimizer groups: {len(state.optimizer.groups)} here, {len(layout.groups)} saved")
    if problems:
        raise CheckpointError(
            f"DeepSpeed checkpoint {layout.path} does not match the model ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems)
        )


def _check_buffers(
    layout: DeepSpeedLayout, model: dict[str, Any], state: TrainState
) -> dict[str, torch.Tensor]:
    module_sd = model.get("module") or {}
    here = state_dict_buffers(state.module)
    problems = [f"missing in the checkpoint: buffer {n!r}" for n in here if n not in module_sd]
    problems += [
        f"shape mismatch: buffer {n!r} is {list(t.shape)} here, {list(module_sd[n].shape)} saved"
        for n, t in here.items()
        if n in module_sd and tuple(module_sd[n].shape) != tuple(t.shape)
    ]
    if problems:
        raise CheckpointError(
            f"DeepSpeed checkpoint {layout.path / layout.model_files[0]} does not match the model's "
            "buffers:\n  " + "\n  ".join(problems)
        )
    return {n: module_sd[n] for n in here}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything read and checked before anything is written."""

    layout: DeepSpeedLayout
    ranks: dict[int, RankState]
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, list[tuple[int, int, torch.Tensor]]]


def _prepare(state: TrainState, path: Path, pieces: dict[str, LocalPiece]) -> _Plan:
    """Read every file (no pickled code runs), check it against the model; write nothing."""
    _, model_files, optim_files = _files(path)
    models = [safe_load(path / f) for f in model_files]
    optims = [safe_load(path / f) for f in optim_files]
    layout = read_layout(path, models[0], optims[0])
    _check_matches(layout, pieces, state)
    buffers = _check_buffers(layout, models[0], state)
    ranks = {r: read_rank(layout, r, o) for r, o in enumerate(optims)}
    opt = state.optimizer
    for g in range(len(layout.groups)):
        saved = set(ranks[0].state[g])
        have = set(elementwise_state(opt, g))
        if have and have != saved:
            raise CheckpointError(
                f"{path / optim_files[0]}: optimizer group {g} has state {sorted(saved)}, the optimizer "
                f"here {sorted(have)}: build zero's optimizer as DeepSpeed's was"
            )
        here = set(opt.torch_optimizer.param_groups[g]) - {"params"}
        foreign = sorted(k for k in ranks[0].hyper[g] if k not in here)
        if foreign and ranks[0].hyper[g]:
            raise CheckpointError(
                f"{path / optim_files[0]}: optimizer group {g} has hyperparameters {foreign} that the "
                f"optimizer here ({type(opt.torch_optimizer).__name__}) does not: build zero's optimizer as "
                "DeepSpeed's was"
            )
    return _Plan(layout, ranks, buffers, _frozen_sources(layout, models, pieces))


def _frozen_sources(
    layout: DeepSpeedLayout, models: list[dict[str, Any]], pieces: dict[str, LocalPiece]
) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
    """Per frozen parameter, its saved ``(start, stop, values)`` pieces."""
    out: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for name, shape in layout.frozen.items():
        numel = math.prod(shape)
        if layout.stage < 3:
            value = models[0]["module"].get(name)
            if value is None:
                raise CheckpointError(
                    f"{layout.path / layout.model_files[0]}: no value for frozen parameter {name!r}"
                )
            out[name] = [(0, numel, value.reshape(-1))]
            continue
        each = math.ceil(numel / layout.world)
        out[name] = []
        for r, model in enumerate(models):
            frag = (model.get("frozen_param_fragments") or {}).get(name)
            lo, hi = min(r * each, numel), min((r + 1) * each, numel)
            if frag is None:
                raise CheckpointError(
                    f"{layout.path / layout.model_files[r]}: no fragment of frozen parameter {name!r}"
                )
            out[name].append((lo, hi, frag.reshape(-1)))
    return out


def _apply(state: TrainState, plan: _Plan, pieces: dict[str, LocalPiece]) -> None:
    """Copy the overlaps into this rank's pieces, buffers, optimizer scalars and counters."""
    layout, ranks, opt = plan.layout, plan.ranks, state.optimizer
    states = []
    for g in range(len(layout.groups)):
        master = opt.groups[g].master
        ostate = opt.torch_optimizer.state[master]
        for key, tensors in ranks[0].state[g].items():
            if key not in ostate:
                ostate[key] = torch.zeros_like(master, dtype=tensors[0].dtype)
        states.append({k: ostate[k] for k in ranks[0].state[g]})
    fragments = layout.fragments()
    for name, p in pieces.items():
        if not p.trainable:
            for a, b, values in plan.frozen[name]:
                lo, hi = max(a, p.start), min(b, p.stop)
                if lo < hi:
                    p.padded.narrow(0, lo - p.start, hi - lo).copy_(values.narrow(0, lo - a, hi - lo))
            continue
        group = states[p.optimizer_group]
        p.padded.zero_()
        for t in group.values():
            t.narrow(0, p.offset, p.partition_numel).zero_()
        for f in fragments[name]:
            lo, hi = max(f.start, p.start), min(f.stop, p.stop)
            if lo >= hi:
                continue
            src = f.offset + lo - f.start
            p.padded.narrow(0, lo - p.start, hi - lo).copy_(
                _take(ranks[f.rank].weights[f.group], src, hi - lo)
            )
            for key, t in group.items():
                values = _take(ranks[f.rank].state[f.group][key], src, hi - lo)
                t.narrow(0, p.offset + lo - p.start, hi - lo).copy_(values)
    for key, t in state_dict_buffers(state.module).items():
        t.copy_(plan.buffers[key])
    _restore_scalars(state, plan)


def _restore_scalars(state: TrainState, plan: _Plan) -> None:
    opt = state.optimizer
    rank0 = plan.ranks[0]
    for g, pg in enumerate(opt.torch_optimizer.param_groups):
        for key, value in rank0.hyper[g].items():
            current = pg.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(float(value))
            elif key in pg:
                pg[key] = tuple(value) if isinstance(current, tuple) else value
        master = opt.groups[g].master
        on_device = bool(pg.get("capturable") or pg.get("fused"))
        ostate = opt.torch_optimizer.state[master]
        for key, value in rank0.scalars[g].items():
            if isinstance(value, torch.Tensor):
                ostate[key] = value.to(master.device if on_device else "cpu", copy=True)
            else:
                ostate[key] = value
    steps = plan.layout.global_steps
    gas = state.counters.gradient_accumulation_steps
    state.counters.restore(steps, steps * gas, gas)


def load_deepspeed_checkpoint(
    state: TrainState, directory: str | Path, tag: str | None = None, *, timeout: float | None = None
) -> Path:
    """Restore ``state`` from a checkpoint DeepSpeed wrote in ``directory/tag`` (``tag=None``: the
    one ``directory/latest`` names), at any world size.
    """
    directory = Path(directory)
    wait = state.timeout if timeout is None else timeout
    with record_function("zero.checkpoint.load_deepspeed"):
        tag = safety.resolve_tag(directory, tag)
        path = directory / tag
        pieces = local_pieces(state.module, state.optimizer)
        with state.optimizer.materialized_state():
            plan, err = None, None
            try:
                plan = _prepare(state, path, pieces)
            except (CheckpointError, KeyError, TypeError, IndexError) as exc:
                err = (
                    str(exc)
                    if isinstance(exc, CheckpointError)
                    else f"{path}: not DeepSpeed's layout ({exc!r})"
                )
            raise_if_failed(exchange(err, wait), f"loading DeepSpeed checkpoint {path}")
            with torch.no_grad():
                _apply(state, plan, pieces)
        commit_loaded(state, pieces)
    logger.info(
        "zero: loaded DeepSpeed checkpoint %s (ZeRO stage %d, world size %d)",
        path,
        plan.layout.stage,
        plan.layout.world,
    )
    return path
