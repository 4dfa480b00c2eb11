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
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

import zero_params
from zero_comm import CommLedger, CommStreams, CommTotals, CommWatchdog, NoStreams, Topology, broadcast
from zero_comm.closing import ClosesOnExit
from zero_comm.devices import default_store
from zero_comm.profiling import profile_range
from zero_coord import Coordinator, StepStats
from zero_full import checkpoint as _checkpoint
from zero_full.checkpoint import LoadOptions, LRSchedulerLike, SaveOptions, StepCounters, TrainState
from zero_full.config.compat import ConfigReport
from zero_full.config.prepare import key_findings, log_config_report, prepare_config
from zero_full.config.zero_config import ZeroConfig
from zero_full.guards.agreement import agree_on_robustness, check_agreement
from zero_full.guards.calls import CallGuard
from zero_full.guards.frozen import TrainableSet
from zero_full.hf import load as hf_load
from zero_full.hf import save as hf_save
from zero_full.inference import gathered_for_inference
from zero_full.lifecycle import EngineResources, track
from zero_full.memory.rank_memory import reset_peak_memory
from zero_full.memory.report import MemoryReport, build_memory_report, model_state_bytes
from zero_full.monitor import TrainingMonitor
from zero_full.wiring.compiled import check_not_precompiled, compile_model, explain_graph_break
from zero_full.wiring.init import ConfigLike, Init
from zero_full.wiring.mics import MicsGroups
from zero_full.wiring.optimizers import optimizer_factory
from zero_full.wiring.placement import place_model
from zero_full.wiring.schedulers import build_scheduler
from zero_full.wiring.stages import StepPipeline, build_stage
from zero_full.wiring.zeropp import check_zeropp_layout, env_ranks_per_node
from zero_optim import LossScaler, OptimizerSpec, PartitionedOptimizer, check_replicas_consistent

__all__ = ["Engine", "EngineStats", "Init", "initialize"]

logger = logging.getLogger("zero.engine")

DeviceLike = torch.device | str | None

_BROADCAST_CHUNK = 1 << 24  # elements per broadcast when syncing a model that was built whole


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


class Engine(ClosesOnExit):
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
        device: The device the model trains on and its shards live on (``initialize(device=...)``).
        counters: The step counters (``gradient_accumulation_steps``, ``micro_steps``,
            ``global_steps``, also readable as properties of the engine).
        lr_scheduler: An LR scheduler over ``optimizer.torch_optimizer``: the config's
            ``scheduler`` section, else ``None``; assign another to replace it. ``step()`` steps
            it after each applied optimizer step; checkpoints save and restore its state.
        last_step_applied: Whether the last optimizer step was applied (``False`` when it was
            skipped for inf / nan gradients, or before the first one).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ZeroConfig,
        optimizer: OptimizerSpec,
        device: DeviceLike = None,
        config_report: ConfigReport | None = None,
    ) -> None:
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
        self.device = place_model(model, device)  # before any collective: errors on every rank
        self.module = model
        self.counters = StepCounters(_accumulation_steps(config, dist.get_world_size()))
        self._backward_since_step = False  # step() without a backward before it is refused
        self.lr_scheduler: LRSchedulerLike | None = None  # the config's, once the optimizer exists
        self.last_step_applied = False
        self.watchdog: CommWatchdog | None = _watchdog(config)  # every collective below runs under it
        self._resources = EngineResources(self.watchdog)  # bounds the process groups' timeouts
        self._ledger = CommLedger(Topology(), watchdog=self.watchdog)
        self._calls = CallGuard(self.watchdog, self.counters)  # armed once ranks agree on robustness
        with self._ledger, record_function("zero.engine.initialize"), _closes_on_error(self._resources):
            agree_on_robustness(config)  # first: the checks it turns on add collectives
            self._calls.arm(config.robustness)
            if config.robustness.check_rank_agreement:  # before any collective whose sizes could differ
                check_agreement(model, config)
            _sync_whole_tensors(model)
            pieces = build_stage(model, config, _optimizer_spec(config, optimizer), self._ledger.topology)
            self.optimizer: PartitionedOptimizer = pieces.optimizer
            self.coordinator: Coordinator | None = pieces.coordinator
            self._pipeline = StepPipeline(pieces, config)
            self.lr_scheduler = build_scheduler(config, self.optimizer.torch_optimizer)
            self._resources.adopt(pieces.coordinator, pieces.reduction, pieces.optimizer)
        self._trainable = TrainableSet(model)  # requires_grad is fixed from here on
        self._monitor = TrainingMonitor(config, model, self.train_state())  # the config's monitoring
        self._release = track(self, self._resources)  # at interpreter exit if never closed
        self._comm = CommTotals()
        self._ledger.records.clear()
        if dist.get_rank() == 0:
            log_config_report(config_report if config_report is not None else key_findings(config), logger)

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
            zero_full.guards.frozen.RequiresGradChangedError: a parameter's ``requires_grad``
                changed since ``initialize`` (with grad enabled; also checked by :meth:`backward`).
        """
        if torch.is_grad_enabled():
            self._trainable.check()
        site = "engine.forward" if torch.is_grad_enabled() else "engine.forward (no grad)"
        with (
            self._ledger,
            self._calls.call(site, communicates=self.coordinator is not None),  # stage 3 gathers
            profile_range("zero.engine.forward"),
            self._monitor.counting_forward(),
        ):
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
        self._trainable.check()
        # below stage 3 a backward before the boundary only accumulates gradients: no collective
        communicates = self.coordinator is not None or self.is_gradient_accumulation_boundary()
        with (
            self._ledger,
            self._calls.call("engine.backward", communicates=communicates),
            profile_range("zero.engine.backward"),
        ):
            if self._pipeline.pieces.reduction is not None:
                self._pipeline.pieces.reduction.begin_micro_step(self.is_gradient_accumulation_boundary())
            self._pipeline.pieces.begin_backward()
            factor = self._pipeline.loss_scale / self.gradient_accumulation_steps
            scaled = loss.float() * factor if factor != 1.0 else loss  # fp32: a 16-bit loss x scale overflows
            scaled.backward()
        self._monitor.record_loss(loss)
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
        self._calls.refuse("engine.step")  # this rank's backward failed alone: name it, not the counters
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
        with self._calls.deferred("engine.step"), self._ledger, profile_range("zero.engine.step"):
            self.last_step_applied = self._pipeline.run(self.global_steps)
            if self.last_step_applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.global_steps += 1
        self._monitor.after_step(self.train_state(), self.grad_norm, self._ledger.records)
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
        """Release gathered parameters, remove the hooks, delete offload swap files, stop the watchdog.

        Idempotent, no collective (safe after a failed one); also run on leaving ``with
        initialize(...) as engine:`` and, for an engine never closed, at interpreter exit. See
        :mod:`zero_full.lifecycle`.
        """
        self._release.detach()  # nothing left for interpreter exit
        self._monitor.close()
        self._resources.close()

    # ------------------------------------------------------------------ MiCS

    @property
    def mics(self) -> MicsGroups | None:
        """The MiCS shard / replicate groups (``None`` unless ``mics_shard_size`` is set)."""
        return self._pipeline.pieces.mics

    @property
    def comm_streams(self) -> CommStreams | NoStreams:
        """The side streams of gathers and gradient reductions: ``zero_comm.CommStreams`` on the
        accelerator (every stage), ``zero_comm.NO_STREAMS`` otherwise."""
        return self._pipeline.pieces.streams

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
            self._calls.check("engine.check_replicas_consistent")
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
        """What a checkpoint saves and restores: module, optimizer, config, counters, scaler, MiCS
        groups, LR scheduler."""
        return TrainState(
            self.module,
            self.optimizer,
            self.config,
            self.counters,
            self.loss_scaler,
            self.mics,
            self.lr_scheduler,
        )

    def save_checkpoint(
        self,
        directory: str | os.PathLike[str],
        tag: str | None = None,
        *,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        overwrite: bool = False,
    ) -> Path:
        """Write a sharded, atomic checkpoint to ``directory/tag`` (default tag ``global_step{N}``).

        ``client_state`` is saved beside it (read back with
        ``zero_full.checkpoint.read_client_state``); ``overwrite=True`` replaces an existing
        tag atomically (else it is refused). Collective: call on every rank; a rank that does
        not take part within ``robustness.comm_timeout`` makes the others raise. See
        :func:`zero_full.checkpoint.save_checkpoint` and :class:`~zero_full.checkpoint.SaveOptions`.
        """
        options = SaveOptions(client_state, save_latest, exclude_frozen_parameters, overwrite)
        self._calls.check("engine.save_checkpoint")
        return _checkpoint.save_checkpoint(self.train_state(), directory, tag, options=options)

    def load_checkpoint(
        self,
        directory: str | os.PathLike[str],
        tag: str | None = None,
        *,
        strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> Path:
        """Restore from ``directory/tag`` (``None``: ``directory/latest``), at any world size and stage.

        The keywords narrow what is restored (:class:`~zero_full.checkpoint.LoadOptions`).
        Collective: call on every rank. See :func:`zero_full.checkpoint.load_checkpoint`. A
        checkpoint DeepSpeed wrote is recognised and read by
        :func:`zero_full.checkpoint.load_deepspeed_checkpoint` (the keywords do not apply).
        """
        self._calls.check("engine.load_checkpoint")
        if _checkpoint.is_deepspeed_checkpoint(directory, tag):
            return _checkpoint.load_deepspeed_checkpoint(self.train_state(), directory, tag)
        options = LoadOptions(strict, load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return _checkpoint.load_checkpoint(self.train_state(), directory, tag, options=options)

    def consolidated_state_dict(self, params: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Full fp32 weights keyed like ``module.state_dict()`` on rank 0 (``{}`` on other ranks).

        Collective: call on every rank; gathers one parameter at a time (``params``: only the
        parameters of these names, no buffers). See :func:`zero_full.checkpoint.consolidated_state_dict`.
        """
        self._calls.check("engine.consolidated_state_dict")
        return _checkpoint.consolidated_state_dict(self.train_state(), params)

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
        self._calls.check("engine.save_pretrained")
        return hf_save.save_pretrained(
            self.train_state(), directory, max_shard_size=max_shard_size, dtype=dtype
        )

    def load_pretrained(self, path: str | os.PathLike[str], *, strict: bool = True) -> Any:
        """Fill the model from a safetensors checkpoint (a ``save_pretrained`` directory or file).

        Each rank reads only its own partition of each tensor into the fp32 master (or the
        working tensor of frozen parameters); the optimizer state is left as it is.
        Collective: call on every rank. Returns a :class:`zero_full.LoadReport`.
        """
        self._calls.check("engine.load_pretrained")
        return hf_load.load_into_state(self.train_state(), path, strict=strict)

    def gathered_for_inference(
        self, budget_bytes: int | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Gather every parameter once for many forwards (``model.generate``), hooks paused.

        ``with engine.gathered_for_inference(): out = engine.module.generate(...)``: one
        all-gather on entry instead of one per layer and token, ``torch.no_grad()`` inside,
        released on exit. ``budget_bytes`` smaller than the gathered model raises (naming
        the bytes needed) before gathering. Collective. See :mod:`zero_full.inference`.
        """
        self._calls.check("engine.gathered_for_inference")
        return gathered_for_inference(self.module, self.coordinator, budget_bytes)

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
        report = build_memory_report(self.train_state(), dist.get_rank(), dist.get_world_size())
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
        return model_state_bytes(self.module, self.optimizer)


def initialize(
    model: nn.Module,
    config: ConfigLike = None,
    optimizer: OptimizerSpec = None,
    *,
    device: DeviceLike = None,
    strict_config: bool = False,
) -> Engine:
    """Wrap ``model`` for ZeRO training over the default process group.

    Args:
        model: The model, built whole on every rank (same values: rank 0's are broadcast) or
            under :class:`Init`.
        config: A :class:`ZeroConfig`, a DeepSpeed-style dict or a path to a JSON file. A
            DeepSpeed config is taken as DeepSpeed takes it (``zero_full.config.prepare``):
            ``"auto"`` values are filled in from the model and batch settings, DeepSpeed keys
            without effect and unknown keys are reported once (rank 0, WARNING, one table).
        optimizer: A callable ``params -> torch optimizer`` (e.g.
            ``lambda params: torch.optim.AdamW(params, lr=1e-3)``; per-group options are
            kept), a torch optimizer without state built over ``model.parameters()``, or
            ``None`` to use the config's ``optimizer`` section (else ``torch.optim.AdamW``).
        device: Where the model trains and its shards live (``None``: the current accelerator
            when the process group serves it, e.g. ``cuda:<current>`` under NCCL, else the
            CPU). Parameters and buffers not partitioned yet are moved there.
        strict_config: Keys neither zero nor DeepSpeed knows are an error instead of reported.

    Returns:
        The :class:`Engine`.

    Raises:
        NotImplementedError: any feature listed by ``ZeroConfig.unsupported_features()``
            (all named at once).
        ValueError: both ``optimizer`` and a config ``optimizer`` section; inconsistent batch sizes;
            ``zero_full.config.compat.ConfigError``: config values zero cannot honour.
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: ``model`` was wrapped by ``torch.compile`` (compile after: ``engine.compile()``).
        ValueError: ``device`` is not served by the process group, or the model is on several
            devices, on ``meta``, or partitioned on another device (names the parameter).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    zero_config, report = prepare_config(config, model, world_size, strict=strict_config)
    return Engine(model, zero_config, optimizer, device, report)


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
def _closes_on_error(resources: EngineResources) -> Iterator[None]:
    """Stop the watchdog's thread and restore the timeouts when ``initialize`` fails (no engine owns them)."""
    try:
        yield
    except BaseException:
        resources.close()
        raise


def _watchdog(config: ZeroConfig) -> CommWatchdog | None:
    r = config.robustness
    if not r.watchdog or dist.get_world_size() == 1:
        return None
    rank, store = dist.get_rank(), default_store()
    # The n-th engine of every rank gets namespace n: engines are built on every rank in one
    # order, and a live engine's heartbeat never lands on another engine's record.
    n = store.add(f"zero/engines/rank{rank}", 1) if store is not None else 0
    return CommWatchdog(
        store,
        rank,
        dist.get_world_size(),
        timeout=r.comm_timeout,
        heartbeat_interval=r.heartbeat_interval,
        namespace=f"engine{n}/",
    )  # its checks are armed once every rank agreed on them (CallGuard.arm)


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
    return optimizer_factory(config.optimizer)


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
