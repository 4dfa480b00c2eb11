"""``initialize(model, config, optimizer) -> Engine``: the training loop's one object.

The engine wires the layers for ZeRO stage 0, 1, 2 or 3 over the whole process group
(after broadcasting rank 0's values, so every rank starts from the same model; the stage
pieces are built by :func:`zero_full.wiring.stages.build_stage`):

* stage 3: ``zero_params.partition`` (unless the model was built under :class:`Init`),
  ``zero_optim.stage3_optimizer`` and a ``zero_coord.Coordinator`` whose hooks gather,
  prefetch and release parameters and hand each gradient to the bucketed sink;
* MiCS (stage 3 with ``mics_shard_size``): the same, partitioned over shard groups of
  ``mics_shard_size`` ranks and replicated across them, with the replicate-group gradient
  all-reduce at the accumulation boundary (see :mod:`zero_full.wiring.mics`);
* stages 0, 1, 2: ``zero_optim.replicated_optimizer`` (whole parameters; see
  :mod:`zero_optim.stage12`).

A training step is ``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.
``backward`` scales the loss by ``loss_scale / gradient_accumulation_steps`` (like
DeepSpeed; the scale is 1 unless fp16) and ``step`` runs, only at the accumulation boundary,
the :class:`zero_full.wiring.stages.StepPipeline`: overflow check (fp16: skipped on every rank),
unscaling, ``gradient_clipping``, the optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

import zero_optim
import zero_params
from zero_comm import CommLedger, CommTotals, CommWatchdog, Topology, broadcast
from zero_comm.profiling import profile_range
from zero_coord import Coordinator, StepStats
from zero_full import checkpoint as _checkpoint
from zero_full.checkpoint import StepCounters, TrainState
from zero_full.config.zero_config import Precision, ZeroConfig
from zero_full.guards.agreement import check_agreement
from zero_full.memory.report import MemoryReport, build_memory_report, reset_peak_memory
from zero_full.wiring.comm_dtype import comm_strategies
from zero_full.wiring.compiled import check_not_precompiled, compile_model, explain_graph_break
from zero_full.wiring.mics import MicsGroups, build_mics_groups
from zero_full.wiring.stages import StepPipeline, build_stage, working_dtype
from zero_full.wiring.zeropp import build_zeropp, check_zeropp_layout, env_ranks_per_node
from zero_optim import LossScaler, OptimizerSpec, PartitionedOptimizer, check_replicas_consistent

__all__ = ["Engine", "EngineStats", "Init", "initialize"]

logger = logging.getLogger("zero.engine")

ConfigLike = ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None

_BROADCAST_CHUNK = 1 << 24  # elements per broadcast when syncing a model that was built whole


class Init(zero_params.Init):
    """``zero_params.Init`` configured from a :class:`ZeroConfig`: partition while constructing.

    ``with zero_full.Init(config=cfg): model = build()`` partitions every parameter as it
    is created, with the config's ``stage3_param_persistence_threshold`` (and in the bf16 /
    fp16 working dtype when that section is enabled); it is active only when the config
    selects stage 3 (other stages keep whole parameters). With ``mics_shard_size`` the
    parameters are partitioned over this rank's MiCS shard group (gathered hierarchically
    with ``mics_hierarchical_params_gather``); the layout is validated against the world
    here, so ``torch.distributed`` must be initialised before constructing it.

    Args:
        config: A :class:`ZeroConfig`, a DeepSpeed-style dict or a JSON path; ``None`` takes
            every ``zero_params.Init`` default.
        **kwargs: Passed to ``zero_params.Init`` (explicit values win over the config's).

    Raises:
        ValueError: an invalid MiCS layout for this world (the message names the numbers).
        RuntimeError: MiCS is configured but ``torch.distributed`` is not initialised.
    """

    def __init__(self, config: ConfigLike = None, **kwargs: Any) -> None:
        if config is not None:
            cfg = ZeroConfig.coerce(config)
            z = cfg.zero_optimization
            kwargs.setdefault("param_persistence_threshold", z.param_persistence_threshold)
            kwargs.setdefault("enabled", cfg.stage == 3)
            if cfg.precision is not Precision.FP32:
                kwargs.setdefault("dtype", working_dtype(cfg))  # partition in the bf16 / fp16 working dtype
            topology = None
            if kwargs["enabled"] and cfg.stage == 3 and z.mics_enabled and "group" not in kwargs:
                topology = Topology()
                mics = build_mics_groups(z, topology)
                kwargs["group"] = mics.shard
                kwargs.setdefault("gather_strategy", mics.gather_strategy)
            elif kwargs["enabled"] and cfg.stage == 3:
                comm = comm_strategies(cfg, kwargs.get("group"))  # communication_data_type
                if comm.gather is not None:
                    kwargs.setdefault("gather_strategy", comm.gather)
                if comm.reduce_scatter is not None:
                    kwargs.setdefault("reduce_strategy", comm.reduce_scatter)
            if kwargs["enabled"] and z.zeropp_enabled:
                zpp = build_zeropp(z, topology if topology is not None else Topology(), kwargs.get("group"))
                if zpp.gather is not None:
                    kwargs["gather_strategy"] = zpp.gather
                if zpp.reduce is not None:
                    kwargs["reduce_strategy"] = zpp.reduce
                kwargs.setdefault("secondary_strategy", zpp.secondary)
        super().__init__(**kwargs)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What the last optimizer step cost.

    Attributes:
        global_steps: Optimizer steps taken so far.
        params: The coordinator's statistics of its last finished step (a training or an
            evaluation forward): peak live gathered elements, gathers, prefetch hits/misses,
            bytes gathered.
        comm: Every zero-comm collective the engine's calls issued between the previous
            optimizer step and the last one (forwards, backwards and the step itself):
            calls, payload bytes and ring-ideal wire bytes.
        skipped_steps: fp16 optimizer steps skipped so far because some rank's gradients
            held an inf / nan (every rank skipped them).
        loss_scale: The current fp16 loss scale (1 in fp32 / bf16).
    """

    global_steps: int
    params: StepStats
    comm: CommTotals
    skipped_steps: int = 0
    loss_scale: float = 1.0


class _Counter:
    """An :class:`Engine` attribute that reads and writes the same-named field of ``engine.counters``."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, engine: None, owner: type | None = None) -> _Counter: ...

    @overload
    def __get__(self, engine: Engine, owner: type | None = None) -> int: ...

    def __get__(self, engine: Engine | None, owner: type | None = None) -> int | _Counter:
        return self if engine is None else int(getattr(engine.counters, self.name))

    def __set__(self, engine: Engine, value: int) -> None:
        setattr(engine.counters, self.name, value)


class Engine:
    """A model trained with ZeRO (stage 0, 1, 2 or 3) over the default process group.

    Build it with :func:`initialize`.

    Attributes:
        module: The model (its parameters partitioned, its modules hooked).
        config: The validated configuration.
        optimizer: The partitioned optimizer (``optimizer.param_groups`` are the torch
            optimizer's groups: adjust ``lr`` there or through an LR scheduler built on
            ``optimizer.torch_optimizer``).
        coordinator: The parameter coordinator (traces, statistics); ``None`` below stage 3.
        watchdog: The collective watchdog (``robustness`` section; ``None`` when disabled):
            a stuck collective raises ``zero_comm.CollectiveTimeoutError`` on every live rank.
        counters: The step counters (``gradient_accumulation_steps``, ``micro_steps``,
            ``global_steps``, also readable as properties of the engine).
    """

    def __init__(self, model: nn.Module, config: ZeroConfig, optimizer: OptimizerSpec) -> None:
        _check_supported(config)
        if not isinstance(model, nn.Module):
            raise TypeError(f"initialize(model=...) needs an nn.Module, got {type(model).__name__}")
        check_not_precompiled(model)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "zero_full.initialize needs torch.distributed: call torch.distributed.init_process_group "
                "first (e.g. init_process_group('gloo') under torchrun)"
            )
        world = dist.get_world_size()  # ZeRO++ layout errors name the keys, before Topology's own checks
        check_zeropp_layout(config.zero_optimization, world, env_ranks_per_node(world))
        self.config = config
        self.module = model
        self.counters = StepCounters(_accumulation_steps(config, dist.get_world_size()))
        self._backward_since_step = False  # step() without a backward before it is refused
        self.watchdog: CommWatchdog | None = _watchdog(config)  # every collective below runs under it
        self._ledger = CommLedger(Topology(), watchdog=self.watchdog)
        with self._ledger, record_function("zero.engine.initialize"), _closes_on_error(self.watchdog):
            if config.robustness.check_rank_agreement:  # before any collective whose sizes could differ
                check_agreement(model, config)
            _sync_whole_tensors(model)
            pieces = build_stage(model, config, _optimizer_spec(config, optimizer), self._ledger.topology)
            self.optimizer: PartitionedOptimizer = pieces.optimizer
            self.coordinator: Coordinator | None = pieces.coordinator
            self._pipeline = StepPipeline(pieces, config)
        self._comm = CommTotals()
        self._ledger.records.clear()
        ignored = config.key_report().ignored
        if ignored and dist.get_rank() == 0:
            logger.info(
                "zero: these config keys have no effect with this configuration: %s",
                "; ".join(f"{f.path} ({f.reason})" for f in ignored),
            )

    def __repr__(self) -> str:
        return (
            f"Engine(stage={self.config.stage}, model={type(self.module).__name__}, "
            f"world_size={dist.get_world_size()}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
            f"global_steps={self.global_steps})"
        )

    # ------------------------------------------------------------------ training step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (``engine.module(*args, **kwargs)``, counted in :attr:`stats`).

        Raises:
            zero_params.PartitionedParameterError: the forward used a parameter that was not
                gathered (a module reading another module's parameter without
                ``register_external_parameter``); the message names the parameter, the module
                and the fix.
        """
        with self._ledger, profile_range("zero.engine.forward"):
            try:
                return self.module(*args, **kwargs)
            except Exception as exc:
                explain_graph_break(exc, self.config.stage)
                raise

    def compile(self, **kwargs: Any) -> None:
        """``torch.compile`` the model in place (``model.compile(**kwargs)``), after the engine's hooks.

        Under stage 3 every hooked module boundary is a graph break (the coordinator's hooks
        run eagerly); see :mod:`zero_full.wiring.compiled`.

        Args:
            **kwargs: ``torch.compile`` options (``backend``, ``mode``, ``dynamic``, ...).

        Raises:
            ValueError: ``fullgraph=True`` under stage 3.
        """
        compile_model(self.module, self.config.stage, **kwargs)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss * loss_scale / gradient_accumulation_steps`` (gradients reach the partitions).

        Args:
            loss: The scalar loss of this micro-step (as returned by the forward).

        Returns:
            ``loss`` unchanged.

        Raises:
            ValueError: ``loss`` is not a scalar tensor that requires grad.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            if isinstance(loss, torch.Tensor):
                what = f"a tensor of shape {tuple(loss.shape)} (requires_grad={loss.requires_grad})"
            else:
                what = f"a {type(loss).__name__}"
            raise ValueError(
                f"engine.backward(loss) needs a scalar loss that requires grad, got {what}; "
                "pass the loss computed by engine(...) with grad enabled"
            )
        with self._ledger, profile_range("zero.engine.backward"):
            if self._pipeline.pieces.reduction is not None:
                self._pipeline.pieces.reduction.begin_micro_step(self.is_gradient_accumulation_boundary())
            self._pipeline.pieces.begin_backward()
            factor = self._pipeline.loss_scale / self.gradient_accumulation_steps
            scaled = loss.float() * factor if factor != 1.0 else loss  # fp32: a 16-bit loss x scale overflows
            scaled.backward()
        self._backward_since_step = True
        return loss

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler (``state_dict`` / ``load_state_dict``); ``None`` in fp32 / bf16."""
        return self._pipeline.scaler

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last applied optimizer step.

        Measured when ``gradient_clipping`` is set (the clip computes it); ``None`` otherwise
        and before the first step. Trainer integrations log it as ``grad_norm``.
        """
        return self._pipeline.last_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` call runs the optimizer."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> None:
        """End a micro-step; at the accumulation boundary, step the optimizer and zero the gradients.

        Raises:
            RuntimeError: no :meth:`backward` since the previous ``step()`` (nothing changes:
                no counter moves, no weight decay is applied).
            zero_full.NonFiniteGradientError: fp32 / bf16 inf / nan gradients with
                ``robustness.nonfinite_gradients = "raise"`` (on every rank).
        """
        if not self._backward_since_step:
            raise RuntimeError(
                f"engine.step() called with no engine.backward(loss) since the last step() (micro-step "
                f"{self.micro_steps}, optimizer step {self.global_steps}): nothing was done. Call "
                "engine.backward(loss) once per micro-batch before each step()"
            )
        self._backward_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        with self._ledger, profile_range("zero.engine.step"):
            self._pipeline.run(self.global_steps)
        self.global_steps += 1
        self._comm = self._ledger.totals()
        self._ledger.records.clear()

    def train(self, mode: bool = True) -> Engine:
        """``module.train(mode)``; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """``module.eval()``; returns the engine."""
        self.module.eval()
        return self

    def close(self) -> None:
        """Release gathered parameters, remove the hooks, delete offload swap files, stop the watchdog."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.coordinator is not None:
            self.coordinator.remove()
        if self._pipeline.pieces.reduction is not None:
            self._pipeline.pieces.reduction.remove()
        self.optimizer.close()

    # ------------------------------------------------------------------ MiCS

    @property
    def mics(self) -> MicsGroups | None:
        """The MiCS shard / replicate groups (``None`` unless ``mics_shard_size`` is set)."""
        return self._pipeline.pieces.mics

    def check_replicas_consistent(self) -> None:
        """Debug check: every MiCS replica of this rank's partition holds the same optimizer state.

        Collective over the replicate group (call on every rank; not every step: it reads all
        optimizer state). A no-op without MiCS.

        Raises:
            zero_optim.ReplicaMismatchError: names the replicate group and the first differing
                tensor and parameter.
        """
        mics = self.mics
        if mics is not None:
            check_replicas_consistent(self.optimizer, mics.replicate)

    # ------------------------------------------------------------------ checkpoints

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.counters.gradient_accumulation_steps

    micro_steps = _Counter()
    """``step()`` calls so far (read and written through :attr:`counters`)."""

    global_steps = _Counter()
    """Optimizer steps taken so far (read and written through :attr:`counters`)."""

    def train_state(self) -> TrainState:
        """What a checkpoint saves and restores: module, optimizer, config, counters, scaler, MiCS groups."""
        return TrainState(
            self.module, self.optimizer, self.config, self.counters, self.loss_scaler, self.mics
        )

    def save_checkpoint(self, directory: str | os.PathLike[str], tag: str | None = None) -> Path:
        """Write a sharded, atomic checkpoint to ``directory/tag`` (default tag ``global_step{N}``).

        Collective: call on every rank; a rank that does not take part within
        ``robustness.comm_timeout`` makes the others raise. See
        :func:`zero_full.checkpoint.save_checkpoint`.
        """
        return _checkpoint.save_checkpoint(self.train_state(), directory, tag)

    def load_checkpoint(self, directory: str | os.PathLike[str], tag: str | None = None) -> Path:
        """Restore from ``directory/tag`` (``None``: ``directory/latest``), at any world size and stage.

        Collective: call on every rank. See :func:`zero_full.checkpoint.load_checkpoint`.
        """
        return _checkpoint.load_checkpoint(self.train_state(), directory, tag)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights keyed like ``module.state_dict()`` on rank 0 (``{}`` on other ranks).

        Collective: call on every rank; gathers one parameter at a time. See
        :func:`zero_full.checkpoint.consolidated_state_dict`.
        """
        return _checkpoint.consolidated_state_dict(self.train_state())

    # ------------------------------------------------------------------ Hugging Face checkpoints

    def save_pretrained(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
    ) -> Any:
        """Write the trained weights (and the model's HF config) in the Hugging Face layout.

        ``model.safetensors``, or ``model-0000x-of-0000y.safetensors`` + index above
        ``max_shard_size``; streamed one tensor at a time. Collective: call on every rank.
        See :func:`zero_full.hf.save.save_pretrained`.
        """
        from zero_full.hf import save as hf_save

        return hf_save.save_pretrained(self, directory, max_shard_size=max_shard_size, dtype=dtype)

    def load_pretrained(self, path: str | os.PathLike[str], *, strict: bool = True) -> Any:
        """Fill the model from a safetensors checkpoint (a ``save_pretrained`` directory or file).

        Each rank reads only its own partition of each tensor into the fp32 master (or the
        working tensor of frozen parameters); the optimizer state is left as it is.
        Collective: call on every rank. Returns a :class:`zero_full.LoadReport`.
        """
        from zero_full.hf import load as pretrained

        return pretrained.load_into_engine(self, path, strict=strict)

    def gathered_for_inference(
        self, budget_bytes: int | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Gather every parameter once for many forwards (``model.generate``), hooks paused.

        ``with engine.gathered_for_inference(): out = engine.module.generate(...)``: one
        all-gather on entry instead of one per layer and token, ``torch.no_grad()`` inside,
        released on exit. ``budget_bytes`` smaller than the gathered model raises (naming
        the bytes needed) before gathering. Collective. See :mod:`zero_full.inference`.
        """
        from zero_full import inference

        return inference.gathered_for_inference(self, budget_bytes)

    # ------------------------------------------------------------------ measurements

    @property
    def stats(self) -> EngineStats:
        """Statistics of the last step (see :class:`EngineStats`)."""
        params = self.coordinator.last_step_stats if self.coordinator is not None else StepStats()
        return EngineStats(
            self.global_steps, params, self._comm, self._pipeline.skipped_steps, self._pipeline.loss_scale
        )

    def memory_report(self, reset_peak: bool = False) -> MemoryReport:
        """This rank's real memory now, next to the ZeRO formula (no collective; log it per step).

        The report holds the process's RSS and its peak since the last reset (on Linux from
        ``/proc/self/status``; elsewhere only the peak since start, said so), the accelerator's
        allocated and peak bytes when there is one (``torch.accelerator``), the model-state
        bytes counted from the engine's storages (:meth:`model_state_bytes`, a second figure)
        and the formula's bytes for this stage. ``str(report)`` is one readable line.

        Args:
            reset_peak: After reading, reset the peaks (as :meth:`reset_peak_memory`), so the
                next report's peak is the next step's.
        """
        report = build_memory_report(self, dist.get_rank(), dist.get_world_size())
        if reset_peak:
            reset_peak_memory()
        return report

    def reset_peak_memory(self) -> bool:
        """Reset the peak RSS (``/proc/self/clear_refs``) and the accelerator's peak to the current values.

        Call it at the start of a step: the next :meth:`memory_report`'s peak is that step's.

        Returns:
            Whether the process peak could be reset (``False`` without ``/proc``: the peak is
            then the process's since it started).
        """
        return reset_peak_memory()

    def model_state_bytes(self) -> int:
        """Bytes of this rank's model states: parameters, gradients and optimizer state.

        Counted from tensor storages, each storage once: parameter storages (empty for
        partitioned parameters that are not gathered, whole for persistent ones), the flat
        fp32 master (which holds the shards), the hpZ secondary shards, the flat gradient
        partitions, any ``.grad`` still attached and the optimizer state.
        """
        tensors: list[torch.Tensor] = []
        stores: dict[int, zero_params.FrozenInt8Store] = {}
        for p in self.module.parameters():
            tensors.append(p)
            if p.grad is not None:
                tensors.append(p.grad)
            if zero_params.is_partitioned(p):
                state = zero_params.state_of(p)
                tensors.append(state.shard)
                if isinstance(state.offload, zero_params.FrozenInt8Store):  # int8 frozen shards
                    stores[id(state.offload)] = state.offload
                if state.secondary_shard is not None:  # hpZ
                    tensors.append(state.secondary_shard)
                if state.grad_partition is not None:
                    tensors.append(state.grad_partition)
        for store in stores.values():
            tensors.extend(store.tensors())
        tensors.extend(self.optimizer.state_tensors())
        offloaded = zero_optim.offloaded_shards(self.optimizer)
        if offloaded is not None:
            tensors.extend(offloaded.host_tensors())
        storages: dict[int, int] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def initialize(model: nn.Module, config: ConfigLike = None, optimizer: OptimizerSpec = None) -> Engine:
    """Wrap ``model`` for ZeRO training over the default process group.

    Args:
        model: The model, built whole on every rank (same values: rank 0's are broadcast) or
            under :class:`Init`.
        config: A :class:`ZeroConfig`, a DeepSpeed-style dict or a path to a JSON file.
        optimizer: A callable ``params -> torch optimizer`` (e.g.
            ``lambda params: torch.optim.AdamW(params, lr=1e-3)``; per-group options are
            kept), a torch optimizer without state built over ``model.parameters()``, or
            ``None`` to use the config's ``optimizer`` section (else ``torch.optim.AdamW``).

    Returns:
        The :class:`Engine`.

    Raises:
        NotImplementedError: any feature listed by ``ZeroConfig.unsupported_features()``
            (all named at once).
        ValueError: both ``optimizer`` and a config ``optimizer`` section; inconsistent batch sizes.
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``model`` was wrapped by ``torch.compile`` (compile after: ``engine.compile()``).
    """
    return Engine(model, ZeroConfig.coerce(config), optimizer)


# ---------------------------------------------------------------------------- helpers


def _check_supported(config: ZeroConfig) -> None:
    """Refuse, naming each one, the features this engine does not implement yet."""
    missing = list(config.unsupported_features())
    if missing:
        lines = "\n  - ".join(missing)
        raise NotImplementedError(
            f"this zero version cannot run the given config; not implemented yet:\n  - {lines}\n"
            "Remove or change these keys."
        )


@contextlib.contextmanager
def _closes_on_error(watchdog: CommWatchdog | None) -> Iterator[None]:
    """Stop the watchdog's thread when ``initialize`` fails (no engine will own it)."""
    try:
        yield
    except BaseException:
        if watchdog is not None:
            watchdog.close()
        raise


def _watchdog(config: ZeroConfig) -> CommWatchdog | None:
    r = config.robustness
    if not r.watchdog or dist.get_world_size() == 1:
        return None
    return CommWatchdog(
        None,
        dist.get_rank(),
        dist.get_world_size(),
        timeout=r.comm_timeout,
        heartbeat_interval=r.heartbeat_interval,
        check_paths=r.check_paths,
    )


def _accumulation_steps(config: ZeroConfig, world_size: int) -> int:
    if config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None:
        return config.gradient_accumulation_steps or 1
    return config.resolve_batch(world_size).gradient_accumulation_steps


def _optimizer_spec(config: ZeroConfig, optimizer: OptimizerSpec) -> OptimizerSpec:
    if config.optimizer is None:
        return optimizer
    if optimizer is not None:
        raise ValueError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' section: "
            "keep one of them"
        )
    return config.optimizer.build


def _sync_whole_tensors(model: nn.Module) -> None:
    """Broadcast rank 0's values of every parameter and buffer not partitioned yet.

    ``zero_params.partition`` does not communicate: each rank keeps its shard of its own
    values, so ranks that built the model with different seeds would silently train a mix.
    One broadcast per dtype and device and per chunk of ``_BROADCAST_CHUNK`` elements, in the
    same order on every rank.
    """
    if dist.get_world_size() == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in dict.fromkeys([*model.parameters(), *model.buffers()]):
        if t.numel() and not zero_params.is_partitioned(t):
            groups.setdefault((t.dtype, t.device), []).append(t.detach())
    with torch.no_grad():
        for tensors in groups.values():
            chunk: list[torch.Tensor] = []
            numel = 0
            for i, t in enumerate(tensors):
                chunk.append(t)
                numel += t.numel()
                if i + 1 == len(tensors) or numel + tensors[i + 1].numel() > _BROADCAST_CHUNK:
                    flat = broadcast(torch.cat([c.reshape(-1) for c in chunk]), src=0)
                    for c, part in zip(chunk, flat.split([c.numel() for c in chunk])):
                        c.copy_(part.view_as(c))
                    chunk, numel = [], 0
