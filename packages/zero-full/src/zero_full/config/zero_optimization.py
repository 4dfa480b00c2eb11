"""``zero_optimization``: the ZeRO stage and its knobs, with the offload and ZeRO++ sub-sections.

DeepSpeed's names and defaults; every key is declared once here (see :mod:`zero_full.config.types`).
"""

from __future__ import annotations

import enum
import sys
import typing
from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from zero_full.config.base import Section, key_report
from zero_full.config.types import (
    IMPLEMENTED,
    USED,
    Choice,
    Flag,
    Ignored,
    Int,
    Key,
    OptionalPath,
    Real,
    Refused,
    Rejected,
    UsedWhen,
)

if typing.TYPE_CHECKING:  # the lower packages are imported only when a mapping is asked for
    from zero_comm.qgz_feedback import ErrorFeedbackConfig
    from zero_coord import CoordinatorConfig
    from zero_offload import OptimizerOffloadConfig, ParamOffloadConfig
    from zero_optim.buckets import ReduceConfig


__all__ = [
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroOptimizationConfig",
    "ZeroppLocoConfig",
]


class OffloadDevice(str, enum.Enum):
    """Where offloaded state lives (DeepSpeed's ``offload_*.device``)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


Device = Choice(OffloadDevice)
_STAGE3 = frozenset({3})
_STAGE12 = frozenset({1, 2})
_REDUCES_ASYNC = UsedWhen(
    "stage 0 or 1, or `overlap_comm` is true", lambda zero, _: zero.stage <= 1 or zero.overlap_comm
)


_NVME = UsedWhen("`device` is `nvme`", lambda section, _: section.device is OffloadDevice.NVME)


class _OffloadSection(Section):
    """What ``offload_param`` and ``offload_optimizer`` share: the device, its NVMe directory, pinning."""

    device: Annotated[Device, USED] = OffloadDevice.NONE
    """``none``, ``cpu`` or ``nvme``."""
    nvme_path: Annotated[OptionalPath, Key(IMPLEMENTED, when=_NVME)] = None
    """Directory for swap files; required with ``nvme``."""

    if typing.TYPE_CHECKING:  # each section declares it, at its own place among its keys
        pin_memory: bool

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadSection:
        if self.device is OffloadDevice.NVME and self.nvme_path is None:
            section = ".".join(self._PATH)
            raise ValueError(
                f"{section}.device is 'nvme' but no nvme_path is given: add "
                f'"nvme_path": "/path/on/nvme" to {section}'
            )
        return self

    @property
    def pinned(self) -> bool:
        """Whether host buffers are asked to be pinned (``pin_memory``, or ``true`` when unset)."""
        return self.pin_memory if "pin_memory" in self.model_fields_set else True

    @property
    def enabled(self) -> bool:
        """Whether this section offloads anything (``device`` is not ``none``)."""
        return self.device is not OffloadDevice.NONE


class OffloadParamConfig(_OffloadSection):
    """``zero_optimization.offload_param`` (stage 3 only), DeepSpeed's defaults."""

    _PATH = ("zero_optimization", "offload_param")

    buffer_count: Annotated[Int(0), USED] = 5
    """Swap buffers for parameters."""
    buffer_size: Annotated[Int(0), USED] = 100_000_000
    """Elements per swap buffer."""
    max_in_cpu: Annotated[Int(0), USED] = 1_000_000_000
    """Elements of parameters kept in CPU memory with ``nvme``."""
    pin_memory: Annotated[Flag, USED] = False
    """Page-locked CPU buffers (faster, overlapping copies to an accelerator). Left unset, they are
    pinned beside an accelerator (DeepSpeed leaves them plain); an explicit ``false`` keeps them plain."""

    def to_param_offload_config(self) -> ParamOffloadConfig | None:
        """This section as a ``zero_offload.ParamOffloadConfig`` (``None`` when not offloaded)."""
        from zero_offload import OffloadTarget, ParamOffloadConfig

        if not self.enabled:
            return None
        return ParamOffloadConfig(
            device=OffloadTarget(self.device.value),
            nvme_path=self.nvme_path,
            buffer_count=max(self.buffer_count, 1),
            buffer_size=max(self.buffer_size, 1),
            max_in_cpu=max(self.max_in_cpu, 1),
            pin_memory=self.pinned,
        )


class OffloadOptimizerConfig(_OffloadSection):
    """``zero_optimization.offload_optimizer`` (stages 1-3), DeepSpeed's defaults.

    ``ratio`` < 1 (partial offload) is valid with stage 3 only, as in DeepSpeed.
    """

    _PATH = ("zero_optimization", "offload_optimizer")

    buffer_count: Annotated[Int(0), USED] = 4
    """Swap buffers for optimizer state."""
    pin_memory: Annotated[Flag, USED] = False
    """Page-locked CPU buffers (faster, overlapping copies to an accelerator). Left unset, they are
    pinned beside an accelerator (DeepSpeed leaves them plain); an explicit ``false`` keeps them plain."""
    pipeline_read: Annotated[Flag, USED] = False
    """Overlap reading swapped state with the step."""
    pipeline_write: Annotated[Flag, USED] = False
    """Overlap writing swapped state with the step."""
    fast_init: Annotated[
        Flag, Key(Ignored("zero writes the initial swap files in one pass whatever this says"))
    ] = False
    """DeepSpeed: skip initialising swap files on creation."""
    ratio: Annotated[Real(0, 1), USED] = 1.0
    """Fraction of each group's sub-groups whose optimizer step and state are offloaded (< 1: partial
    offload, stage 3 only; the rest is stepped on the device; the split is
    ``engine.optimizer.offload.offloaded_numel`` / ``device_numel``)."""

    def to_offload_config(self, sub_group_size: int) -> OptimizerOffloadConfig | None:
        """This section as a ``zero_offload.OptimizerOffloadConfig`` (``None`` when not offloaded)."""
        from zero_offload import OffloadTarget, OptimizerOffloadConfig

        if not self.enabled:
            return None
        return OptimizerOffloadConfig(
            device=OffloadTarget(self.device.value),
            nvme_path=self.nvme_path,
            buffer_count=self.buffer_count,
            pin_memory=self.pinned,
            pipeline_read=self.pipeline_read,
            pipeline_write=self.pipeline_write,
            sub_group_size=sub_group_size,
            ratio=self.ratio,
        )


def _deprecated_offload(new: str) -> Rejected:
    return Rejected(f'a deprecated DeepSpeed key; use {{"{new}": {{"device": "cpu"}}}} instead')


class ZeroppLocoConfig(Section):
    """``zero_optimization.zeropp_loco_param``: error feedback of qgZ (DeepSpeed's names)."""

    _PATH = ("zero_optimization", "zeropp_loco_param")

    err_beta: Annotated[Real(0, 1, hi_open=True), USED] = 0.8
    """Moving-average factor of the qgZ error buffer, in [0, 1): each reduction folds this rank's
    int4 quantization error into the buffer as ``e = err_beta * e + (1 - err_beta) * error`` and
    adds the buffer to the next gradient before quantizing it (0: classic error feedback)."""
    reset_T: Annotated[Int(1), USED] = 1024  # noqa: N815 - DeepSpeed's key
    """Optimizer steps between resets of the qgZ error buffers to zero."""

    def to_feedback_config(self) -> ErrorFeedbackConfig:
        """This section as a ``zero_comm.ErrorFeedbackConfig``."""
        from zero_comm.qgz_feedback import ErrorFeedbackConfig

        return ErrorFeedbackConfig(err_beta=float(self.err_beta), reset_t=int(self.reset_T))


def _stage3(status: Refused | Ignored | None = None, default_text: str | None = None) -> Key:
    """The declaration of a stage-3 knob (implemented unless ``status`` says otherwise)."""
    return Key(status or IMPLEMENTED, stages=_STAGE3, default_text=default_text)


def _sized(value: str, deepspeed: str) -> str:
    """The page's default of a size sized from the model when left unset (``config/sizing.py``)."""
    return f"`min({value}, {deepspeed})`, sized from the model (`u`: its largest parameter, at least 2^20)"


_ALWAYS_RS = "stages 1-3 always reduce-scatter gradients, stage 0 (DDP) all-reduces them"
_SAVE_16BIT = (
    "zero has no save_16bit_model: engine.save_pretrained(dir, dtype=torch.bfloat16) always gathers the "
    "whole weights, and `zero consolidate` turns a checkpoint into whole weights"
)


class ZeroOptimizationConfig(Section):
    """``zero_optimization``: DeepSpeed's ZeRO keys, names and defaults.

    Every stage-3 knob is accepted with and without its ``stage3_`` prefix
    (``stage3_prefetch_bucket_size`` / ``prefetch_bucket_size``); the attribute is the
    short name. ``stage3_gather_fp16_weights_on_model_save`` (DeepSpeed's older name) is
    one more spelling of ``gather_16bit_weights_on_model_save``. Sizes are element
    counts; whole floats such as ``5e8`` are accepted. ``overlap_comm`` defaults to true
    for stage 3 and false otherwise, as in DeepSpeed.

    ``overlap_comm``, ``reduce_max_inflight`` and the bucket sizes are performance settings: they
    never change the numbers a step computes.
    """

    _PATH = ("zero_optimization",)
    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "prefetch_bucket_size": ("stage3_prefetch_bucket_size",),
        "param_persistence_threshold": ("stage3_param_persistence_threshold",),
        "model_persistence_threshold": ("stage3_model_persistence_threshold",),
        "max_live_parameters": ("stage3_max_live_parameters",),
        "max_reuse_distance": ("stage3_max_reuse_distance",),
        "module_granularity_threshold": ("stage3_module_granularity_threshold",),
        "gather_16bit_weights_on_model_save": (
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    }
    _REJECTED: ClassVar[dict[str, Rejected]] = {
        "cpu_offload": _deprecated_offload("offload_optimizer"),
        "cpu_offload_param": _deprecated_offload("offload_param"),
        "cpu_offload_use_pin_memory": Rejected(
            "a deprecated DeepSpeed key; use offload_optimizer.pin_memory / offload_param.pin_memory instead"
        ),
    }

    stage: Annotated[Int(0, 3), USED] = 0
    """0: plain data parallelism (DDP); 1: optimizer state sharded; 2: + gradients; 3: + parameters."""
    overlap_comm: Annotated[
        Flag, Key(IMPLEMENTED, stages=frozenset({2, 3}), default_text="`true` at stage 3, else `false`")
    ] = False
    """Reduce gradient buckets asynchronously while backward goes on. Never changes the numbers.
    Stage 1 always does (each bucket as soon as its gradients are accumulated, in the boundary
    micro-step's backward, as DDP) and stage 0 reduces after backward: neither reads the key."""
    contiguous_gradients: Annotated[
        Flag,
        Key(
            Ignored(
                "zero always reduces gradients into one contiguous flat partition per group", behaves_as=True
            )
        ),
    ] = True
    """DeepSpeed: copy gradients into a contiguous buffer as they are produced."""
    reduce_scatter: Annotated[Flag, Key(Ignored(_ALWAYS_RS, behaves_as=True))] = True
    """DeepSpeed: reduce gradients with reduce-scatter (``false``: all-reduce)."""
    reduce_bucket_size: Annotated[Int(1), Key(IMPLEMENTED, default_text=_sized("u", "5e8"))] = 500_000_000
    """Gradient elements reduced in one bucket (one collective) during backward."""
    reduce_max_inflight: Annotated[Int(1), Key(IMPLEMENTED, when=_REDUCES_ASYNC)] = 1
    """Not a DeepSpeed key. Gradient buckets whose reduction may be in flight at once before
    backward waits for the oldest (stages 0 and 1 always; stages 2 and 3 with ``overlap_comm``).
    Each bucket in flight holds up to ``(2W - 1) / W * reduce_bucket_size`` elements of staging
    and received rows (``2 (W - 1) / W`` at stage 1 without offload, whose whole gradients stay
    in place), so the bound is a memory bound; 1 (the default) keeps DeepSpeed's memory while
    still overlapping a bucket's reduction with the backward of the next. A larger bound lets
    backward run on when a peer is late instead of waiting bucket by bucket: on a small GPT-2 at
    world 2 on CPU, 4 took stage 1 from 1.05x to 1.02x DDP's step and stage 2 from 1.03x to
    1.02x (the benchmarks page); at stage 3 the reductions in flight queue the next gathers
    behind them (slower where measured). Never changes the numbers: the buckets, their order and
    their sums are the same."""
    allgather_partitions: Annotated[
        Flag,
        Key(
            Ignored("stages 1/2 always all-gather the updated partitions after the step", behaves_as=True),
            stages=_STAGE12,
        ),
    ] = True
    """DeepSpeed: all-gather the updated partitions after the step (``false``: a broadcast per rank)."""
    allgather_bucket_size: Annotated[
        Int(1), Key(IMPLEMENTED, stages=_STAGE12, default_text=_sized("u", "5e8"))
    ] = 500_000_000
    """Elements of whole parameters all-gathered in one collective after the step."""
    round_robin_gradients: Annotated[
        Flag,
        Key(
            Ignored(
                "each rank's gradient partition is one contiguous range of its flat buffer", behaves_as=False
            ),
            stages=_STAGE12,
        ),
    ] = False
    """DeepSpeed: place gradient partitions round-robin (balancing its CPU-offload copies)."""
    sub_group_size: Annotated[Int(0), Key(IMPLEMENTED, default_text=_sized("u", "1e9"))] = 1_000_000_000
    """Every stage: elements of a flat optimizer partition stepped at once (and, with
    `offload_optimizer`, swapped at once). The optimizer's temporaries (e.g. AdamW's
    per-element intermediates, up to ~2 fp32 tensors of this size) are bounded by it, not by
    the model; smaller values cost more Python calls per step. 0 (DeepSpeed: one sub-group per
    parameter) steps ranges of the largest parameter's share of a partition (its size over the
    world size), the bound DeepSpeed's per-parameter sub-groups give."""
    load_from_fp32_weights: Annotated[
        Flag, Key(Refused("master weights from 16-bit copies", supported=True))
    ] = True
    """Load the fp32 master weights from a checkpoint's fp32 copies (``false``: from the 16-bit ones)."""
    ignore_unused_parameters: Annotated[Flag, Key(Refused("error on unused parameters", supported=True))] = (
        True
    )
    """Let parameters receive no gradient in a step (``false``: fail when one does not)."""
    prefetch_bucket_size: Annotated[Int(0), _stage3(default_text=_sized("u", "5e7"))] = 50_000_000
    """Elements of upcoming modules' parameters gathered ahead of use, from the recorded trace;
    0 turns prefetching off."""
    param_persistence_threshold: Annotated[Int(0), _stage3()] = 100_000
    """Parameters with at most this many elements are not partitioned (kept whole on every rank,
    never gathered)."""
    model_persistence_threshold: Annotated[
        Int(0),
        _stage3(
            Ignored(
                "not applied: every parameter within param_persistence_threshold stays whole, however many",
                behaves_as=sys.maxsize,
            ),
            default_text="unlimited (`sys.maxsize`)",
        ),
    ] = sys.maxsize
    """DeepSpeed: a cap on the total elements of the parameters kept whole."""
    max_live_parameters: Annotated[Int(0), _stage3(default_text=_sized("2u", "1e9"))] = 1_000_000_000
    """Bound on gathered or in-flight elements that prefetching and reuse may keep alive (the
    running module's parameters are always gathered)."""
    max_reuse_distance: Annotated[Int(0), _stage3(default_text=_sized("u", "1e9"))] = 1_000_000_000
    """A parameter used again within this many gathered elements (in the trace) stays gathered
    after its module."""
    module_granularity_threshold: Annotated[Int(0), _stage3()] = 0
    """Modules whose subtree holds at most this many parameter elements per layer (elements
    divided by the modules with parameters inside, itself included) are gathered as one leaf:
    one gather and one pair of hooks per block of small modules instead of one per module,
    the whole block gathered at once. Chosen from the root down, parents first; torch
    containers and single layers never qualify (DeepSpeed's rule). A GPT-2 block's granularity
    is ``(12 h^2 + 13 h) // 9``; a model made almost only of blocks has one just above it, so a
    higher threshold can make the whole model one leaf (logged as a warning, as is a threshold
    below every module's granularity). 0 turns it off. The modules chosen:
    ``engine.coordinator.leaf_modules``."""
    gather_16bit_weights_on_model_save: Annotated[Flag, _stage3(Ignored(_SAVE_16BIT))] = False
    """DeepSpeed: gather the 16-bit weights for ``save_16bit_model`` (its older name:
    ``stage3_gather_fp16_weights_on_model_save``)."""
    zero_hpz_partition_size: Annotated[Int(1), _stage3()] = 1
    """ZeRO++ hpZ: ranks holding a secondary shard of the parameters (usually the ranks of one
    node; must divide the world size and the ranks per node); backward gathers stay inside the
    node; costs P/n elements per rank. 1 is off. See the ZeRO++ page of the docs."""
    zero_quantized_weights: Annotated[Flag, _stage3()] = False
    """ZeRO++ qwZ: all-gather parameters as int8 codes + fp32 scales, dequantized on arrival;
    masters and optimizer stay exact. See the ZeRO++ page of the docs."""
    zero_quantized_nontrainable_weights: Annotated[Flag, _stage3()] = False
    """ZeRO++: store the shards of frozen parameters (``requires_grad=False`` when ``initialize``
    runs, e.g. the base model under LoRA) as int8 codes + one fp32 scale per 2048 elements
    (~1 byte per element instead of 2-4), quantized once: the frozen values become the
    dequantized ones. Gathers move the codes and dequantize into the working precision;
    checkpoints save the dequantized values. Not with ``offload_param``. See the ZeRO++ page of
    the docs."""
    zero_quantized_gradients: Annotated[Flag, _stage3()] = False
    """ZeRO++ qgZ: reduce gradients quantized to int4 with two all-to-all hops (inside the node,
    then across); 1-D and indivisible tensors exactly. Needs a world of whole nodes. See
    the ZeRO++ page of the docs."""
    zeropp_loco_param: Annotated[ZeroppLocoConfig | None, _stage3()] = None
    """With ``zero_quantized_gradients``: error feedback for qgZ, DeepSpeed's
    ``{"err_beta": 0.8, "reset_T": 1024}`` (section below); absent or null: no error feedback.
    Costs one buffer per quantized gradient, of the gradient's full size, in working precision."""
    mics_shard_size: Annotated[Int(-1), _stage3()] = -1
    """Ranks per MiCS shard group; -1 (or 0) turns MiCS off. Must divide the world size (checked
    by ``initialize`` / ``Init``, where the world is known)."""
    mics_hierarchical_params_gather: Annotated[Flag, _stage3()] = False
    """MiCS: gather in two hops (inter-node, then intra-node); needs ``mics_shard_size`` set to a
    multiple of the ranks per node spanning >= 2 nodes."""
    offload_param: Annotated[OffloadParamConfig, _stage3()] = Field(default_factory=OffloadParamConfig)
    """Where parameters live between uses (section below)."""
    offload_optimizer: Annotated[OffloadOptimizerConfig, Key(IMPLEMENTED, stages=frozenset({1, 2, 3}))] = (
        Field(default_factory=OffloadOptimizerConfig)
    )
    """Where the optimizer state and its step live (section below)."""

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        # DeepSpeed: overlap_comm defaults to true for stage 3, false otherwise.
        # Filled only where it differs from the field's default, so that stages 0 and 1 (which
        # do not use the key) report it as ignored only when the user gave it.
        if "overlap_comm" not in data and data.get("stage") == 3:
            data["overlap_comm"] = True
        # DeepSpeed accepts "offload_param": null for "no offload".
        for key in ("offload_param", "offload_optimizer", "zeropp_loco_param"):
            if key in data and data[key] is None:
                del data[key]
        return data

    @model_validator(mode="after")
    def _partial_offload_needs_stage3(self) -> ZeroOptimizationConfig:
        if self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio = {self.offload_optimizer.ratio:g} (partial "
                f"offload) needs stage 3, got stage {self.stage}; set ratio to 1.0 or use stage 3"
            )
        return self

    @model_validator(mode="after")
    def _hierarchical_gather_needs_mics(self) -> ZeroOptimizationConfig:
        if self.stage == 3 and self.mics_hierarchical_params_gather and not self.mics_enabled:
            raise ValueError(
                "zero_optimization.mics_hierarchical_params_gather = true needs MiCS: set "
                f"mics_shard_size to the shard group size (got {self.mics_shard_size}), or turn the "
                "hierarchical gather off"
            )
        return self

    @model_validator(mode="after")
    def _zeropp_needs_stage3(self) -> ZeroOptimizationConfig:
        if self.stage == 3:
            if self.loco_enabled and not self.zero_quantized_gradients:
                raise ValueError(
                    "zero_optimization.zeropp_loco_param is the error feedback of qgZ and needs "
                    "zero_quantized_gradients = true (got false); set it or drop zeropp_loco_param"
                )
            return self
        wanted = [
            f"{k} = true"
            for k in (
                "zero_quantized_weights",
                "zero_quantized_gradients",
                "zero_quantized_nontrainable_weights",
            )
            if getattr(self, k)
        ]
        if self.zero_hpz_partition_size > 1:
            wanted.append(f"zero_hpz_partition_size = {self.zero_hpz_partition_size}")
        if wanted:
            raise ValueError(
                f"zero_optimization.{', '.join(wanted)} (ZeRO++) needs stage 3, got stage {self.stage}: "
                "ZeRO++ quantizes and re-partitions the stage-3 parameter gathers and gradient "
                "reduction; set stage to 3 or turn these keys off"
            )
        return self

    @model_validator(mode="after")
    def _frozen_int8_not_offloaded(self) -> ZeroOptimizationConfig:
        if (
            self.stage == 3
            and self.zero_quantized_nontrainable_weights
            and self.offload_param.device is not OffloadDevice.NONE
        ):
            raise ValueError(
                "zero_optimization.zero_quantized_nontrainable_weights = true cannot be combined with "
                f"offload_param.device = {self.offload_param.device.value!r}: a frozen shard lives "
                "either as int8 codes or in the offload store, not both; turn one of them off"
            )
        return self

    @property
    def loco_enabled(self) -> bool:
        """Whether qgZ error feedback was asked for (``zeropp_loco_param`` given, not null)."""
        return self.zeropp_loco_param is not None

    @property
    def zeropp_enabled(self) -> bool:
        """Whether any ZeRO++ feature is requested (stage 3)."""
        return self.stage == 3 and (
            self.zero_quantized_weights
            or self.zero_quantized_gradients
            or self.zero_quantized_nontrainable_weights
            or self.zero_hpz_partition_size > 1
        )

    @property
    def mics_enabled(self) -> bool:
        """Whether MiCS is requested (``mics_shard_size`` > 0)."""
        return self.mics_shard_size > 0

    def to_coordinator_config(self) -> CoordinatorConfig:
        """The ZeRO-3 fetch / prefetch / release policy as a ``zero_coord.CoordinatorConfig``."""
        from zero_coord import CoordinatorConfig

        return CoordinatorConfig(
            prefetch_bucket_size=self.prefetch_bucket_size,
            max_live_parameters=self.max_live_parameters,
            max_reuse_distance=self.max_reuse_distance,
            module_granularity_threshold=self.module_granularity_threshold,
        )

    def to_reduce_config(self) -> ReduceConfig:
        """The gradient bucketing policy as a ``zero_optim`` ``ReduceConfig``."""
        from zero_optim.buckets import ReduceConfig

        return ReduceConfig(
            reduce_bucket_size=self.reduce_bucket_size,
            overlap_comm=self.overlap_comm,
            max_inflight=self.reduce_max_inflight,
        )

    def ignored_keys(self) -> list[str]:
        """Full paths of the keys given here that have no effect (see ``ZeroConfig.ignored_keys``)."""
        return [finding.path for finding in key_report(self, self.stage).ignored]
