"""The implementations the side-by-side benchmark compares, behind one small interface.

Each implementation builds the :mod:`workloads` model itself (same seed, so the same
weights everywhere) and returns a :class:`Runner`: ``forward(batch) -> loss`` and
``backward(loss)`` (or both at once, ``forward_backward(batch) -> loss``),
``optimizer_step()`` (which also zeroes the gradients) and ``state_roots()``, the objects
from which its model-state bytes are counted (:func:`model_state_bytes`).

* ``single``: one process, the whole global batch, torch AdamW (the numerical reference).
* ``ddp``: ``DistributedDataParallel`` (``gradient_as_bucket_view=True``, so the gradients
  are the reducer's buckets and are counted).
* ``fsdp2``: ``fully_shard`` on every block and on the root (parameters resharded after
  forward), torch AdamW over the DTensor shards.
* ``deepspeed-1/2/3``: ``deepspeed.initialize`` with torch's AdamW as the client optimizer
  (``zero_allow_untested_optimizer``), fp32, ``DS_ACCELERATOR=cpu`` over the gloo group the
  benchmark created.
* ``zero-1/2/3``: ``zero_full.initialize`` with the same ``zero_optimization`` section and
  the same torch AdamW; at stages 1 and 2 plus zero's own ``reduce_max_inflight`` (4 by
  default, :class:`ImplOptions`: up to four gradient buckets reducing at once, a key
  DeepSpeed has no equivalent of).

Every AdamW is ``benchmarks.kit.workloads.adamw`` (all hyperparameters explicit). The ZeRO sections of
DeepSpeed and zero are the same dict (:func:`zero_section`): buckets scaled to the model,
``overlap_comm`` at stages 2 and 3 (DDP overlaps its reduction with backward too), and at
stage 3 parameters really released after use (by default, :class:`ImplOptions`:
persistence threshold 4096 elements, so only biases and norms stay whole; prefetch half a
block; 1.5 blocks live at most; no reuse). Builders take ``(workload, world, options)``;
``options.checkpointing`` turns on activation checkpointing of every block.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from benchmarks.kit.workloads import (
    Workload,
    adamw,
    block_modules,
    build_model,
    enable_checkpointing,
    loss_of,
)

__all__ = [
    "IMPLEMENTATIONS",
    "ImplOptions",
    "Runner",
    "block_numel",
    "formula_state_bytes",
    "model_state_bytes",
    "reachable_tensors",
    "ring_ideal_bytes",
    "stage_of",
    "storage_bytes",
    "zero_section",
]


# ----------------------------------------------------------------------------- formulas


def stage_of(impl: str) -> int:
    """The ZeRO stage an implementation corresponds to (``single`` / ``ddp``: 0, ``fsdp2``: 3)."""
    if impl in ("single", "ddp"):
        return 0
    if impl == "fsdp2":
        return 3
    return int(impl.split("-")[1])  # zero-3, zero-3-compiled, zero-3-unset, deepspeed-2


def formula_state_bytes(impl: str, psi: int, world: int) -> float:
    """Model-state bytes per rank of fp32 AdamW (4 bytes each of param, grad, m, v) by the ZeRO formula.

    DDP 16P; stage 1 8P + 8P/N; stage 2 4P + 12P/N; stage 3 (and FSDP2) 16P/N.
    """
    n = 1 if impl == "single" else world
    stage = stage_of(impl)
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def ring_ideal_bytes(impl: str, psi: int, world: int) -> float:
    """Bytes a rank sends per step over an ideal ring, fp32: 2P(N-1)/N x 4 (DDP, stages 1, 2);
    3P(N-1)/N x 4 (stage 3, FSDP2: all-gather in forward and backward, reduce-scatter); 0 alone."""
    if impl == "single" or world == 1:
        return 0.0
    rounds = 3 if stage_of(impl) == 3 else 2
    return rounds * psi * (world - 1) / world * 4


# ----------------------------------------------------------------------------- counting storages

_SKIP = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.CodeType,
    str,
    bytes,
    int,
    float,
    bool,
    complex,
    torch.dtype,
    torch.device,
)


def _children(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        yield from obj.keys()
        yield from obj.values()
    elif isinstance(obj, list | tuple | set | frozenset | deque):
        yield from obj
    elif isinstance(obj, types.MethodType):
        yield obj.__self__
    elif isinstance(obj, functools.partial):
        yield from (obj.func, *obj.args, *obj.keywords.values())
    else:
        yield from getattr(obj, "__dict__", {}).values()
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    yield getattr(obj, slot)


def reachable_tensors(roots: Iterable[Any], limit: int = 2_000_000) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` through attributes, slots, containers and hooks.

    Walks ``__dict__`` and ``__slots__`` of objects (so modules' parameters, buffers and hook
    dicts, optimizers' state, engines' buffers), dict keys and values, sequences, bound
    methods' ``self`` and ``functools.partial`` arguments; a tensor's ``.grad`` and its own
    ``__dict__`` (attributes some libraries attach to parameters) too. A DTensor is replaced by
    its local tensor. Functions' closures and the autograd graph are not walked. Stops with an
    error after ``limit`` objects.
    """
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, _SKIP) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            raise RuntimeError(f"reachable_tensors: more than {limit} objects reachable; pass narrower roots")
        if isinstance(obj, torch.Tensor):
            if isinstance(obj, DTensor):
                stack.append(obj._local_tensor)
            else:
                found.append(obj)
            if obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(getattr(obj, "__dict__", {}).values())
            continue
        stack.extend(_children(obj))
    return found


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage once, whole, views included)."""
    storages: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta" or t.is_sparse:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_state_bytes(runner: Runner) -> int:
    """Bytes of the storages reachable from the runner's state roots (see :func:`reachable_tensors`)."""
    return storage_bytes(reachable_tensors(runner.state_roots()))


# ----------------------------------------------------------------------------- runners


@dataclasses.dataclass(frozen=True)
class ImplOptions:
    """What a builder may vary beyond the workload (defaults: the side-by-side benchmark's).

    Attributes:
        persistence_threshold: Stage 3: parameters of at most this many elements stay whole.
        prefetch_blocks: Stage 3: prefetch bucket, in blocks (:func:`block_numel`).
        live_blocks: Stage 3: most gathered parameters alive at once, in blocks.
        reuse_blocks: Stage 3: ``stage3_max_reuse_distance``, in blocks; ``0`` (the default)
            releases every parameter after use unless the very next module needs it.
        checkpointing: Activation checkpointing of every block (non-reentrant).
        bucket_blocks: ``reduce_bucket_size`` and ``allgather_bucket_size``, in blocks.
        sub_group_blocks: ``sub_group_size`` (elements the optimizer steps at once), in
            blocks; ``None`` keeps DeepSpeed's default (1e9 elements: the whole partition).
        overlap_comm: Stages 2 and 3: reduce gradient buckets asynchronously during backward
            (as DDP does; DeepSpeed's default is false at stage 2); ``None`` leaves the key out
            (each implementation's default). Stage 1 never gets the key: zero always overlaps
            there and would report it as ignored.
        leaf_blocks: Stage 3, GPT-2 only: ``stage3_module_granularity_threshold`` at the
            granularity of one block (:func:`block_granularity`; DeepSpeed's key: zero and
            DeepSpeed alike gather each block as one leaf, and nothing larger, as long as the
            embeddings outweigh ~5 hidden-wide rows per vocabulary entry: see that function);
            ``False`` leaves the key out (per-module gathers).
        reduce_max_inflight: zero stages 1 and 2 only (a zero key DeepSpeed does not have):
            gradient buckets whose reduction may be in flight at once; ``None`` leaves the key
            out (zero's default, 1). Stage 3 keeps 1: more reductions in flight queue its
            gathers behind them in gloo (measured: slower).
        sizes: ``"blocks"``: the section the options above describe; ``"unset"``: only the
            stage (every other key left to the implementation's defaults: zero sizes them from
            the model); ``"deepspeed"``: the stage and DeepSpeed's default sizes given
            explicitly (:data:`DEEPSPEED_SIZES`: what an empty section meant before zero sized
            its defaults from the model).
    """

    persistence_threshold: int = 4096
    prefetch_blocks: float = 0.5
    live_blocks: float = 1.5
    reuse_blocks: float = 0.0
    checkpointing: bool = False
    bucket_blocks: float = 4.0
    sub_group_blocks: float | None = None
    overlap_comm: bool | None = True
    leaf_blocks: bool = True
    reduce_max_inflight: int | None = 4
    sizes: str = "blocks"


# DeepSpeed's default sizes (elements) and the stages that read them.
DEEPSPEED_SIZES: dict[str, tuple[int, tuple[int, ...]]] = {
    "reduce_bucket_size": (500_000_000, (1, 2, 3)),
    "allgather_bucket_size": (500_000_000, (1, 2)),
    "sub_group_size": (1_000_000_000, (1, 2, 3)),
    "stage3_prefetch_bucket_size": (50_000_000, (3,)),
    "stage3_max_live_parameters": (1_000_000_000, (3,)),
    "stage3_max_reuse_distance": (1_000_000_000, (3,)),
}


def _model(w: Workload, options: ImplOptions) -> nn.Module:
    model = build_model(w)
    if options.checkpointing:
        enable_checkpointing(model)
    return model


class Runner(abc.ABC):
    """One implementation training the workload on this rank."""

    def __init__(self, w: Workload) -> None:
        self.w = w

    @abc.abstractmethod
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward of one micro-batch; returns the loss."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the loss :meth:`forward` returned."""

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the loss."""
        loss = self.forward(batch)
        self.backward(loss)
        return loss

    @abc.abstractmethod
    def optimizer_step(self) -> None:
        """The optimizer step (and zeroing the gradients)."""

    @abc.abstractmethod
    def state_roots(self) -> list[Any]:
        """Objects whose reachable tensors are the model states (module, optimizer, engine)."""

    def close(self) -> None:  # noqa: B027 - optional: most runners hold nothing to release
        """Drop hooks / engines that outlive the runner otherwise."""


class TorchRunner(Runner):
    """A plain module (or DDP / FSDP2-wrapped module) with torch AdamW."""

    def __init__(self, w: Workload, model: nn.Module, call: nn.Module | None = None) -> None:
        super().__init__(w)
        self.model = model
        self.call = call if call is not None else model
        self.optimizer = adamw(model.parameters())

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_of(self.call, self.w, batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_roots(self) -> list[Any]:
        return [self.call, self.model, self.optimizer]


def _single(w: Workload, world: int, options: ImplOptions = ImplOptions()) -> Runner:
    return TorchRunner(w, _model(w, options))


def _ddp(w: Workload, world: int, options: ImplOptions = ImplOptions()) -> Runner:
    model = _model(w, options)
    return TorchRunner(w, model, nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True))


def _fsdp2(w: Workload, world: int, options: ImplOptions = ImplOptions()) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(w, options)
    mesh = init_device_mesh("cpu", (world,))
    for block in block_modules(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TorchRunner(w, model)


def block_numel(w: Workload) -> int:
    """Parameters of one block, about: ``12 hidden^2`` (GPT-2, MLP), ``hidden^2`` (Linear stack)."""
    return w.hidden * w.hidden * (1 if w.kind == "linear" else 12)


def block_granularity(w: Workload) -> int:
    """DeepSpeed's module granularity of one GPT-2 block: ``(12 h^2 + 13 h) // 9``.

    Its parameters (two LayerNorms, the attention's ``c_attn`` / ``c_proj`` and the MLP's
    ``c_fc`` / ``c_proj``, weights and biases: ``12 h^2 + 13 h``) over its 9 modules with
    parameters (those six, the attention, the MLP, the block). Used as the threshold, it selects
    the blocks and, parents coming first, nothing above them as long as the model's own
    granularity is larger: with the tied head counted twice, when the vocabulary is above ~4
    hidden sizes (the GPT-2 of ``GPT2Model``: ~5.3); the benchmark and memory workloads are
    (8192 entries against hidden sizes of 128 to 1024).
    """
    h = w.hidden
    return (12 * h * h + 13 * h) // 9


def leaf_threshold(w: Workload, options: ImplOptions) -> int | None:
    """``stage3_module_granularity_threshold`` of ``options`` on ``w``: one block's granularity
    with ``leaf_blocks`` on a GPT-2, ``None`` (the key left out) otherwise (a Linear stack or an
    MLP has no blocks)."""
    return block_granularity(w) if options.leaf_blocks and w.kind == "gpt2" else None


def zero_section(stage: int, w: Workload, options: ImplOptions = ImplOptions()) -> dict[str, Any]:
    """The ``zero_optimization`` section shared by DeepSpeed and zero (sizes in elements)."""
    if options.sizes == "unset":
        return {"stage": stage}
    if options.sizes == "deepspeed":
        given = {k: v for k, (v, stages) in DEEPSPEED_SIZES.items() if stage in stages}
        return {"stage": stage, **given}
    block = block_numel(w)
    section: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "reduce_bucket_size": int(options.bucket_blocks * block),
        "allgather_bucket_size": int(options.bucket_blocks * block),
    }
    if options.sub_group_blocks is not None:
        section["sub_group_size"] = int(options.sub_group_blocks * block)
    if stage >= 2 and options.overlap_comm is not None:
        section["overlap_comm"] = options.overlap_comm
    if stage == 3:
        section.update(
            {
                "stage3_param_persistence_threshold": options.persistence_threshold,
                "stage3_prefetch_bucket_size": int(options.prefetch_blocks * block),
                "stage3_max_live_parameters": int(options.live_blocks * block),
                "stage3_max_reuse_distance": int(options.reuse_blocks * block),
            }
        )
        threshold = leaf_threshold(w, options)
        if threshold is not None:
            section["stage3_module_granularity_threshold"] = threshold
    return section


def zero_own_section(stage: int, w: Workload, options: ImplOptions = ImplOptions()) -> dict[str, Any]:
    """zero's ``zero_optimization`` section: :func:`zero_section` plus zero's own keys (stages 1, 2:
    ``reduce_max_inflight``)."""
    section = zero_section(stage, w, options)
    if stage in (1, 2) and options.reduce_max_inflight is not None and options.sizes == "blocks":
        section["reduce_max_inflight"] = options.reduce_max_inflight
    return section


class EngineRunner(Runner):
    """DeepSpeed's or zero's engine: ``engine(...)``, ``engine.backward``, ``engine.step``."""

    def __init__(self, w: Workload, engine: Any, roots: list[Any]) -> None:
        super().__init__(w)
        self.engine = engine
        self.roots = roots

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_of(self.engine, self.w, batch)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        self.engine.step()

    def state_roots(self) -> list[Any]:
        return self.roots

    def close(self) -> None:  # noqa: B027 - optional: most runners hold nothing to release
        closer = getattr(self.engine, "destroy", None) or getattr(self.engine, "close", None)
        if closer is not None:
            closer()


def _deepspeed(stage: int) -> Callable[..., Runner]:
    def build(w: Workload, world: int, options: ImplOptions = ImplOptions()) -> Runner:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the benchmark's initialised group
        model = _model(w, options)
        config = {
            "train_micro_batch_size_per_gpu": w.micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero_section(stage, w, options),
            "gradient_clipping": 0.0,  # DeepSpeed 0.19.8 clips at 1.0 unless told otherwise
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters()), config=config
        )
        return EngineRunner(w, engine, [engine, optimizer])

    return build


def _zero(stage: int, compiled: bool = False, sizes: str | None = None) -> Callable[..., Runner]:
    def build(w: Workload, world: int, options: ImplOptions = ImplOptions()) -> Runner:
        import zero_full

        if sizes is not None:
            options = dataclasses.replace(options, sizes=sizes)
        model = _model(w, options)
        section = zero_own_section(stage, w, options)
        engine = zero_full.initialize(model, config={"zero_optimization": section}, optimizer=adamw)
        if compiled:  # torch.compile (inductor) after initialize; compiled during the warm-up steps
            engine.compile()
        return EngineRunner(w, engine, [engine])

    return build


IMPLEMENTATIONS: dict[str, Callable[..., Runner]] = {
    "single": _single,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
    **{f"deepspeed-{k}": _deepspeed(k) for k in (1, 2, 3)},
    **{f"zero-{k}": _zero(k) for k in (1, 2, 3)},
    "zero-3-compiled": _zero(3, compiled=True),
    # an empty section (zero's defaults, sized from the model) and DeepSpeed's default sizes given
    **{f"zero-{k}-unset": _zero(k, sizes="unset") for k in (1, 2, 3)},
    **{f"zero-{k}-dsdefaults": _zero(k, sizes="deepspeed") for k in (1, 2, 3)},
}
DEFAULT_SIZES = tuple(f"zero-{k}-{sizes}" for k in (1, 2, 3) for sizes in ("unset", "dsdefaults"))
"""Implementations that compare default sizes: chosen by name only (not in default lists)."""
