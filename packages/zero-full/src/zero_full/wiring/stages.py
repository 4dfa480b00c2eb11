"""Stage construction and the optimizer-step pipeline shared by every stage.

:func:`build_stage` turns a validated config into the pieces the engine drives:

* stage 3: ``zero_params.partition`` + ``zero_optim.stage3_optimizer`` + a
  ``zero_coord.Coordinator`` (gradients reduced by the coordinator's hooks); with
  ``offload_param`` the optimizer hands the shards to a ``zero_params.OffloadedShards``,
  which the coordinator asks to swap in the shards of upcoming modules;
* ZeRO++ (stage 3 with ``zero_quantized_weights``, ``zero_hpz_partition_size``,
  ``zero_quantized_gradients``): the strategies of :func:`zero_full.wiring.zeropp.build_zeropp`
  handed to ``zero_params.partition``;
* MiCS (stage 3 with ``mics_shard_size``): the same over the shard group (see
  :mod:`zero_full.wiring.mics`), plus ``zero_optim.ReplicaGradientSync`` as the reduction: the
  gradient partitions are averaged across the replicate group at the accumulation boundary;
* stages 0, 1, 2: ``zero_optim.replicated_optimizer`` (whole parameters; stage 0 a full
  optimizer on every rank with all-reduced gradients, stage 1 partitioned optimizer state
  with a reduce-scatter at the accumulation boundary, stage 2 partitioned gradients
  reduce-scattered during backward).

:class:`StepPipeline` is what happens at the accumulation boundary, the same for every
stage: pending gradient reduction, fp16 overflow check (one all-reduce of a flag; an
overflow skips the step on every rank), unscaling, global-norm clipping (one all-reduce),
the optimizer step, zeroing the gradient partitions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

import zero_optim
import zero_params
from zero_comm import (
    BOUNDED_DTYPES,
    NO_STREAMS,
    CommStreams,
    GradientBound,
    NoStreams,
    Topology,
    comm_streams,
)
from zero_comm.profiling import profile_range
from zero_coord import Coordinator
from zero_full.config.zero_config import Precision, ZeroConfig
from zero_full.guards.nonfinite import NonFiniteGuard
from zero_full.wiring.comm_dtype import comm_strategies
from zero_full.wiring.dtypes import working_dtype
from zero_full.wiring.mics import MicsGroups, sync_replicas
from zero_full.wiring.param_strategies import param_strategies
from zero_full.wiring.zeropp import feedback_strategies
from zero_optim import (
    GradientReduction,
    LossScaler,
    LossScalerConfig,
    OptimizerSpec,
    PartitionedOptimizer,
    ReplicaGradientSync,
    clip_grad_norm_,
    found_overflow,
)

__all__ = ["StagePieces", "StepPipeline", "build_stage", "working_dtype"]

logger = logging.getLogger("zero.engine")


@dataclasses.dataclass
class StagePieces:
    """What :func:`build_stage` wires: the optimizer, a coordinator and / or a reduction.

    Attributes:
        optimizer: The partitioned optimizer.
        coordinator: Stage 3: gathers parameters and hands gradients to the bucketed sink.
        reduction: Stages 0-2: the gradient path; MiCS: the boundary replicate-group sync.
        mics: The MiCS groups (``None`` unless ``mics_shard_size`` is set).
        feedback: The qgZ error-feedback strategies (``zeropp_loco_param``), told about each
            backward and optimizer step.
        grad_bound: The inf / nan check the gradient reduce-scatter carries (stages 1 and 2,
            and 3 without MiCS, in fp32 / bf16 with the plain reduce-scatter; ``None``: the
            check all-reduces a flag).
        streams: The gather / reduce side streams (``zero_comm.comm_streams``: on the
            accelerator when the group serves it, else ``NO_STREAMS``).
    """

    optimizer: PartitionedOptimizer
    coordinator: Coordinator | None
    reduction: GradientReduction | None
    mics: MicsGroups | None = None
    feedback: list[Any] = dataclasses.field(default_factory=list)
    grad_bound: GradientBound | None = None
    streams: CommStreams | NoStreams = NO_STREAMS

    def begin_backward(self) -> None:
        """Tell the qgZ error-feedback strategies that a backward starts (their reductions restart)."""
        for strategy in self.feedback:
            strategy.begin_backward()

    @property
    def norm_group(self) -> ProcessGroup | None:
        """The ranks whose gradient partitions together hold every element once (``None``: world)."""
        return self.mics.shard if self.mics is not None else None


def parameter_share(model: nn.Module, stage: int) -> int:
    """``sub_group_size = 0``: the largest parameter's share of one rank's partition (at least 1).

    DeepSpeed steps one parameter's partition at a time when ``sub_group_size`` is 0; zero
    steps flat ranges, so it steps ranges of the largest parameter's share: the same bound on
    the optimizer's temporaries (the numbers never depend on the sub-groups).
    """
    largest = max((p.numel() for p in model.parameters()), default=1)
    world = dist.get_world_size() if stage > 0 else 1
    return max(1, math.ceil(largest / world))


def build_stage(
    model: nn.Module, config: ZeroConfig, optimizer: OptimizerSpec, topology: Topology | None = None
) -> StagePieces:
    """Cast the model to the working dtype and build the stage's optimizer and gradient path.

    The model's values must already be identical on every rank (under MiCS, the shards of
    a model built under ``Init`` are made identical across replicas here).

    Args:
        model: The model.
        config: The validated configuration.
        optimizer: The user's optimizer spec.
        topology: Nodes and cached groups (MiCS groups are built from it; default: a new one).

    Raises:
        ValueError: an invalid MiCS layout for this world (see
            :func:`zero_full.wiring.mics.check_mics_layout`).
    """
    z = config.zero_optimization
    dtype = working_dtype(config)
    if dtype != torch.float32:
        _cast_whole(model, dtype)
    # every stage steps its flat partitions sub_group_size elements at a time (offloaded or not)
    sub_group_size = z.sub_group_size or parameter_share(model, config.stage)
    offload = z.offload_optimizer.to_offload_config(sub_group_size)
    streams = comm_streams(_model_device(model))
    if config.stage == 3:
        chosen = param_strategies(config, topology)
        mics = chosen.mics
        built_under_init = any(zero_params.is_partitioned(p) for p in model.parameters())
        chosen.comm.check_partitioned(model)
        reduce = chosen.reduce
        zero_params.partition(
            model,
            mics.shard if mics is not None else None,
            persistence_threshold=z.param_persistence_threshold,
            gather_strategy=chosen.gather,
            reduce_strategy=reduce,
            secondary_strategy=chosen.secondary,
        )
        if mics is not None and built_under_init:  # a whole model was broadcast from rank 0 already
            sync_replicas(model, mics)
        if z.zero_quantized_nontrainable_weights:  # ZeRO++: frozen shards kept as int8 codes
            zero_params.quantize_frozen(model)
        opt, sink = zero_optim.stage3_optimizer(
            model,
            optimizer,
            z.to_reduce_config(),
            working_dtype=dtype,
            offload=offload,
            param_offload=z.offload_param.to_param_offload_config(),
            sub_group_size=sub_group_size,
            # the inf / nan check rides on the plain reduce-scatter over every rank
            bound_grads=mics is None and reduce is None and dtype in BOUNDED_DTYPES,
            streams=streams,
        )
        coordinator = Coordinator(
            model,
            z.to_coordinator_config(),
            sink,
            shard_prefetch=zero_optim.offloaded_shards(opt),
            streams=streams,
        )
        coordinator.install()
        sync = ReplicaGradientSync(opt.groups, mics.replicate) if mics is not None else None
        feedback = feedback_strategies(model) if z.loco_enabled else []
        bound = (
            opt.partitioning.grad_bound
            if isinstance(opt.partitioning, zero_optim.Stage3Partitioning)
            else None
        )
        log_offload(opt)
        return StagePieces(opt, coordinator, sync, mics, feedback, grad_bound=bound, streams=streams)
    comm = comm_strategies(config)  # communication_data_type
    opt, reduction = zero_optim.replicated_optimizer(
        model,
        optimizer,
        config.stage,
        z.to_reduce_config(),
        allgather_bucket_size=z.allgather_bucket_size,
        working_dtype=dtype,
        offload=offload if config.stage >= 1 else None,
        sub_group_size=sub_group_size,
        reduce_strategy=comm.reduce_scatter,
        all_reduce_strategy=comm.all_reduce,
        streams=streams,
    )
    part = opt.partitioning
    bound = part.grad_bound if isinstance(part, zero_optim.ReplicaPartitioning) else None
    log_offload(opt)
    return StagePieces(opt, None, reduction, grad_bound=bound, streams=streams)


def _model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters (a partitioned one's gathers) live: the streams' device."""
    for p in model.parameters():
        return zero_params.state_of(p).device if zero_params.is_partitioned(p) else p.device
    return torch.device("cpu")


def log_offload(opt: zero_optim.PartitionedOptimizer) -> None:
    """Say once (rank 0, INFO) what optimizer offload keeps off the device, and where it lives."""
    if opt.offload is None or opt.placement is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    placement = opt.placement
    moved = "fp32 master, gradient partition and optimizer state" if placement.split else "optimizer state"
    logger.info(
        "zero: optimizer offload keeps %d bytes per rank off %s: %s in %s host memory",
        opt.offloaded_device_bytes,
        placement.device,
        moved,
        "pinned" if placement.memory.pinned else "pageable",
    )


def _cast_whole(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point parameters and buffers that are not partitioned to ``dtype``.

    Parameters partitioned under ``Init`` keep their dtype (``zero_full.Init`` partitions in
    the config's working dtype); a mismatch is refused by ``stage3_optimizer`` by name.
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype and not zero_params.is_partitioned(p):
                p.data = p.data.to(dtype)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point() and buf.dtype != dtype:
                    setattr(module, name, buf.to(dtype))


class StepPipeline:
    """The boundary work of every stage: reduce, overflow check, unscale, clip, step, zero.

    Args:
        pieces: The stage's optimizer and gradient path.
        config: The validated configuration (``fp16``, ``gradient_clipping``, stage).

    Attributes:
        scaler: The fp16 :class:`zero_optim.LossScaler` (``None`` in fp32 / bf16).
        last_grad_norm: Global gradient norm of the last applied step (``None`` without clipping).
    """

    __slots__ = ("_clip", "_partitioned", "guard", "last_grad_norm", "pieces", "scaler")

    def __init__(self, pieces: StagePieces, config: ZeroConfig) -> None:
        self.pieces = pieces
        self._clip = float(config.gradient_clipping)
        self._partitioned = config.stage != 0
        self.last_grad_norm: float | None = None
        self.scaler: LossScaler | None = None
        # fp32 / bf16: inf / nan gradients are found at the step (fp16: the loss scaler's rule)
        self.guard: NonFiniteGuard | None = None
        if config.precision is not Precision.FP16:
            self.guard = NonFiniteGuard(config.robustness.nonfinite_gradients, pieces.norm_group)
        if config.precision is Precision.FP16:
            # the ``fp16`` section names each of the scaler's fields as the scaler does
            f = config.fp16
            names = [field.name for field in dataclasses.fields(LossScalerConfig)]
            self.scaler = LossScaler(LossScalerConfig(**{name: getattr(f, name) for name in names}))

    @property
    def loss_scale(self) -> float:
        """The factor ``engine.backward`` multiplies the loss by (1 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because some rank's gradients overflowed (fp16) or were non-finite."""
        if self.scaler is not None:
            return self.scaler.skipped_steps
        return self.guard.skipped_steps if self.guard is not None else 0

    def run(self, step: int = 0) -> bool:
        """The boundary step on every rank; returns whether the optimizer step was applied.

        Args:
            step: Optimizer steps taken so far (named in non-finite gradient messages).

        Raises:
            zero_full.NonFiniteGradientError: fp32 / bf16 non-finite gradients with the
                ``raise`` policy (on every rank; the gradients are zeroed first).
        """
        opt = self.pieces.optimizer
        if self.pieces.reduction is not None:
            self.pieces.reduction.at_boundary()
        applied = True
        bound = self.pieces.grad_bound
        if self.scaler is not None:
            overflow = bound.nonfinite() if bound is not None else found_overflow(opt.groups)
            scale = self.scaler.scale
            self.scaler.update(overflow)
            if overflow:
                applied = False
                if not dist.is_initialized() or dist.get_rank() == 0:
                    logger.info(
                        "zero: gradient overflow (inf/nan) on some rank: step skipped on every rank, "
                        "loss scale %g -> %g",
                        scale,
                        self.scaler.scale,
                    )
            else:
                with profile_range("zero.optim.unscale"), torch.no_grad():
                    for g in opt.groups:
                        for grad in g.grads():
                            grad.mul_(1.0 / scale)
        if applied:
            finite = True
            if self._clip > 0:  # the norm reduces over every gradient: inf / nan shows in it
                norm = clip_grad_norm_(
                    opt.groups, self._clip, self.pieces.norm_group, partitioned=self._partitioned
                )
                finite = math.isfinite(norm)
                if finite:
                    self.last_grad_norm = norm
            elif self.guard is not None:
                finite = not self.guard.flag_without_norm(opt, bound)
            if not finite and self.guard is not None:
                applied = False
                try:
                    self.guard.handle(opt, step, overflowed=self._check_sum(bound))
                finally:
                    opt.zero_grad()
            if applied:
                opt.step()
        opt.zero_grad()
        for strategy in self.pieces.feedback:
            strategy.step_done()
        return applied

    def _check_sum(self, bound: GradientBound | None) -> str:
        """What the non-finite check summed: named when it overflowed though no element is inf / nan."""
        if self._clip > 0:
            return "the sum of squares of the gradient norm"
        if bound is not None:
            return "the sum of every rank's largest |gradient| (the reduce-scatter's inf/nan check)"
        return "the gradient partitions"
