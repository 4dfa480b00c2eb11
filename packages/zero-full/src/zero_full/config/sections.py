"""Sections of the zero configuration (``fp16``, ``bf16``, ``optimizer``, ``zero_optimization``).

Every section is a frozen pydantic model with ``extra="forbid"`` (:class:`zero_full.config.base.Section`:
unknown keys, ``"auto"`` values and alias conflicts are reported with their DeepSpeed path).
Every key is declared once, here: its type (:mod:`zero_full.config.types`, whose messages name
the accepted range), its :class:`~zero_full.config.types.Key` (the stages that use it, and
whether it is implemented, ignored or refused) and its description (the docstring under it).

:class:`zero_full.config.ZeroConfig` assembles these sections; use it rather than the
sections on their own.
"""

from __future__ import annotations

import enum
import pathlib
import sys
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from zero_full.config.base import Section, key_report
from zero_full.config.types import (
    IMPLEMENTED,
    Betas,
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
    parse_choice,
)

if typing.TYPE_CHECKING:  # the lower packages are imported only when a mapping is asked for
    from zero_comm.qgz_feedback import ErrorFeedbackConfig
    from zero_coord import CoordinatorConfig
    from zero_offload import OptimizerOffloadConfig, ParamOffloadConfig
    from zero_optim.buckets import ReduceConfig

__all__ = [
    "AdamParams",
    "BF16Config",
    "FP16Config",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "NonFinitePolicy",
    "OptimizerType",
    "RobustnessConfig",
    "SGDParams",
    "ZeroOptimizationConfig",
]


class OffloadDevice(str, enum.Enum):
    """Where offloaded state lives (DeepSpeed's ``offload_*.device``)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class OptimizerType(str, enum.Enum):
    """Optimizers the ``optimizer`` section can describe (``type`` is case-insensitive)."""

    ADAM = "Adam"
    ADAMW = "AdamW"
    SGD = "SGD"


Device = Choice(OffloadDevice)
_USED = Key(IMPLEMENTED)  # implemented, at every stage the section is used
_STAGE3 = frozenset({3})
_STAGE12 = frozenset({1, 2})
_REDUCES_ASYNC = UsedWhen(
    "stage 0 or 1, or `overlap_comm` is true", lambda zero, _: zero.stage <= 1 or zero.overlap_comm
)


# --------------------------------------------------------------------------- precision

_FP16_ON = UsedWhen("fp16 is enabled", lambda fp16, _: fp16.enabled)
_DYNAMIC = UsedWhen(
    "fp16 is enabled with dynamic loss scaling (`loss_scale` 0)",
    lambda fp16, _: fp16.enabled and fp16.dynamic_loss_scale,
)


class FP16Config(Section):
    """``fp16``: half precision with loss scaling (DeepSpeed's names and defaults).

    ``loss_scale`` 0 means dynamic loss scaling (DeepSpeed's rule): start at
    ``2**initial_scale_power``; a step whose gradients overflow is skipped, and once
    ``hysteresis`` overflows have been absorbed the scale halves (never below
    ``min_loss_scale``); every ``loss_scale_window`` overflow-free steps the scale doubles
    and the hysteresis budget refills (with ``consecutive_hysteresis``, every overflow-free
    step refills it). A positive ``loss_scale`` is a static scale.
    """

    _PATH = ("fp16",)

    enabled: Annotated[Flag, _USED] = False
    """Train in fp16 with loss scaling (working copies of parameters and gradients in fp16, fp32
    master weights and optimizer state)."""
    auto_cast: Annotated[Flag, Key(Refused("casting inputs to fp16", supported=False), when=_FP16_ON)] = False
    """DeepSpeed's cast of floating-point inputs to fp16."""
    loss_scale: Annotated[Real(0), Key(IMPLEMENTED, when=_FP16_ON)] = 0.0
    """0: dynamic loss scaling; a positive value: this static scale."""
    initial_scale_power: Annotated[Int(0, 127), Key(IMPLEMENTED, when=_DYNAMIC)] = 16
    """Dynamic scaling starts at ``2**initial_scale_power``."""
    loss_scale_window: Annotated[Int(1), Key(IMPLEMENTED, when=_DYNAMIC)] = 1000
    """Overflow-free steps after which the dynamic scale doubles."""
    hysteresis: Annotated[Int(1), Key(IMPLEMENTED, when=_DYNAMIC)] = 2
    """Overflows absorbed before the dynamic scale halves."""
    consecutive_hysteresis: Annotated[Flag, Key(IMPLEMENTED, when=_DYNAMIC)] = False
    """Refill the hysteresis budget after every overflow-free step (not only after
    ``loss_scale_window`` of them)."""
    min_loss_scale: Annotated[Real(0, lo_open=True), Key(IMPLEMENTED, when=_DYNAMIC)] = 1.0
    """The dynamic scale never halves below this."""

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale is dynamic (``loss_scale`` == 0)."""
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        """The first loss scale: ``2**initial_scale_power`` if dynamic, else ``loss_scale``."""
        return float(2**self.initial_scale_power) if self.dynamic_loss_scale else self.loss_scale


class BF16Config(Section):
    """``bf16`` (older DeepSpeed spelling: ``bfloat16``): bfloat16 training, no loss scaling."""

    _PATH = ("bf16",)

    enabled: Annotated[Flag, _USED] = False
    """Train in bfloat16 (working copies of parameters and gradients in bf16, fp32 master weights
    and optimizer state); no loss scaling."""


# --------------------------------------------------------------------------- robustness


class NonFinitePolicy(str, enum.Enum):
    """What an fp32 / bf16 step does when some rank's gradients hold an inf or nan."""

    SKIP = "skip"
    RAISE = "raise"


class RobustnessConfig(Section):
    """``robustness``: what zero checks so that failures are named instead of hanging or corrupting.

    Not a DeepSpeed section. See the "When things go wrong" page of the docs for every failure
    these keys govern and what zero says about it.
    """

    _PATH = ("robustness",)

    comm_timeout: Annotated[Real(0, lo_open=True), _USED] = 300.0
    """Seconds a rank waits for one collective of the engine (forward, backward, step; each exchange of a
    checkpoint save / load, which then raises ``zero_full.CheckpointError``) before every live
    rank raises ``zero_comm.CollectiveTimeoutError`` saying which rank is where (which operation,
    call number, module or parameter), or which rank stopped sending heartbeats. Default 300 s:
    well under the process group's own 30 minutes, well above any healthy collective. Raise it for
    very slow links or very large first gathers."""
    heartbeat_interval: Annotated[Real(0, lo_open=True), _USED] = 2.0
    """Seconds between two heartbeats (and position reports) each rank's watchdog thread writes to
    the process group's store; a rank silent for ``5 * heartbeat_interval`` seconds while the
    others wait is reported as dead or stuck."""
    watchdog: Annotated[Flag, _USED] = True
    """Run the collective watchdog (``false``: collectives block until the process group's own
    timeout, with torch's message)."""
    nonfinite_gradients: Annotated[Choice(NonFinitePolicy), _USED] = NonFinitePolicy.SKIP
    """fp32 / bf16: what a step does when some rank's gradients hold an inf or nan (found by the
    gradient-clipping norm, or by one all-reduce of a flag without clipping). ``skip`` (default):
    the step is skipped on every rank (the optimizer state does not move), with one warning naming
    the first non-finite parameter and the rank holding it; ``raise``: every rank raises
    ``zero_full.NonFiniteGradientError`` naming it. fp16 keeps its loss-scaler rule (skip and
    lower the scale)."""
    check_paths: Annotated[Flag, _USED] = False
    """Before every collective of every step, all-gather a small signature (operation, call
    number, what it is for) and raise ``zero_comm.RanksDivergedError`` on every rank at the first
    difference, naming each rank's position. Off by default: it adds one small collective per
    collective. Without it, stage 3 checks this way only while a step records its module order
    (the first step), and afterwards catches a rank that leaves the recorded order before its
    gather (through the store, no collective). Turn it on for collectives outside the model's
    modules; with gloo mismatched sizes otherwise abort the process in C++ ("Received data size
    doesn't match expected size"), before any timeout could fire."""
    check_rank_agreement: Annotated[Flag, _USED] = True
    """At ``initialize``, compare every rank's parameter names, shapes, dtypes, ``requires_grad``
    flags and effective config values (one all-gather of digests) and raise on every rank naming
    the first difference, instead of aborting in the communication library later."""


# --------------------------------------------------------------------------- optimizer

_NO_MAX_GRAD_NORM = Rejected("gradient clipping is the top-level 'gradient_clipping' key (as in DeepSpeed)")
_ADAM_ONLY = UsedWhen("the optimizer type is `Adam`", lambda _, opt: opt.type is OptimizerType.ADAM)


class AdamParams(Section):
    """``optimizer.params`` of ``Adam`` / ``AdamW`` with DeepSpeed's defaults.

    DeepSpeed builds its Adam(W) with ``weight_decay=0.0`` unless told otherwise (torch's
    ``AdamW`` defaults to 0.01): this config follows DeepSpeed, since its users bring
    DeepSpeed configs. Likewise DeepSpeed's ``Adam`` applies *decoupled* weight decay
    (AdamW) unless ``adam_w_mode`` is ``false``; ``AdamW`` always does.
    """

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: Annotated[Real(0), _USED] = 1e-3
    """Learning rate."""
    betas: Annotated[Betas, _USED] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: Annotated[Real(0), _USED] = 1e-8
    """Term added to the denominator."""
    weight_decay: Annotated[Real(0), _USED] = 0.0
    """Weight decay; DeepSpeed's default 0.0 (torch's ``AdamW`` defaults to 0.01)."""
    amsgrad: Annotated[Flag, _USED] = False
    """The AMSGrad variant."""
    adam_w_mode: Annotated[Flag, Key(IMPLEMENTED, when=_ADAM_ONLY)] = True
    """Decoupled weight decay for type ``Adam`` (DeepSpeed's default: true). No effect on ``AdamW``."""
    bias_correction: Annotated[Flag, Key(Refused("Adam without bias correction", supported=True))] = True
    """Adam's bias correction of the running averages (torch's Adam always applies it)."""
    torch_adam: Annotated[Flag, Key(Ignored("zero always uses torch's Adam update"))] = False
    """DeepSpeed's choice between torch's and its fused kernel.

    (DeepSpeed with ``torch_adam: true`` hands ``params`` to torch unchanged, so there a
    missing ``weight_decay`` means torch's 0.01; zero keeps 0.0: give it explicitly.)
    """


class SGDParams(Section):
    """``optimizer.params`` of ``SGD`` (torch's names and defaults)."""

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: Annotated[Real(0), _USED] = 1e-3
    """Learning rate."""
    momentum: Annotated[Real(0), _USED] = 0.0
    """Momentum factor."""
    dampening: Annotated[Real(0), _USED] = 0.0
    """Dampening of the momentum."""
    weight_decay: Annotated[Real(0), _USED] = 0.0
    """L2 penalty."""
    nesterov: Annotated[Flag, _USED] = False
    """Nesterov momentum (needs ``momentum`` > 0 and ``dampening`` 0)."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "optimizer.params.nesterov = true needs momentum > 0 and dampening = 0, got "
                f"momentum={self.momentum:g}, dampening={self.dampening:g}"
            )
        return self


_PARAMS_BY_TYPE: dict[OptimizerType, type[Section]] = {
    OptimizerType.ADAM: AdamParams,
    OptimizerType.ADAMW: AdamParams,
    OptimizerType.SGD: SGDParams,
}


def _optimizer_type(value: Any) -> OptimizerType:
    return parse_choice(OptimizerType, value)  # type: ignore[return-value]


class OptimizerConfig(Section):
    """``optimizer``: ``{"type": "AdamW", "params": {...}}``; ``params`` is checked per type.

    ``type`` is case-insensitive (``adamw`` = ``AdamW``). :meth:`build` creates the torch
    optimizer the section describes.
    """

    _PATH = ("optimizer",)

    type: Annotated[Choice(OptimizerType), _USED]
    """``Adam``, ``AdamW`` or ``SGD``, any case. ``Adam`` with ``adam_w_mode`` (the default) builds
    ``torch.optim.AdamW``, as DeepSpeed does."""
    params: Annotated[AdamParams | SGDParams, _USED]
    """The optimizer's keyword arguments, checked for its ``type`` (tables below). Omitted: every
    default."""

    @classmethod
    def _child_section(cls, key: str, data: Mapping[str, Any]) -> type[Section] | None:
        if key != "params":
            return super()._child_section(key, data)
        try:
            return _PARAMS_BY_TYPE[_optimizer_type(data.get("type"))]
        except PydanticCustomError:
            return None  # the bad type is reported by field validation

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("params") is None:
            data["params"] = {}  # every default of the type
        return data

    @field_validator("params", mode="wrap")
    @classmethod
    def _params_of_type(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("type")
        if kind is None:
            return None  # ``type`` itself is invalid and reported; its params cannot be checked
        params_cls = _PARAMS_BY_TYPE[kind]
        if isinstance(value, params_cls):
            return value
        if isinstance(value, Section):
            raise PydanticCustomError(
                "params_type",
                f"optimizer type {kind.value} takes {params_cls.__name__}, got {type(value).__name__}",
            )
        return params_cls.model_validate(value)

    @property
    def decoupled_weight_decay(self) -> bool:
        """Whether weight decay is decoupled (AdamW); DeepSpeed's rule for ``Adam`` is ``adam_w_mode``."""
        if self.type is OptimizerType.ADAMW:
            return True
        return (
            self.type is OptimizerType.ADAM
            and isinstance(self.params, AdamParams)
            and self.params.adam_w_mode
        )

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the torch optimizer :meth:`build` creates (``params`` excluded)."""
        p = self.params
        if isinstance(p, SGDParams):
            return {
                "lr": p.lr,
                "momentum": p.momentum,
                "dampening": p.dampening,
                "weight_decay": p.weight_decay,
                "nesterov": p.nesterov,
            }
        if not isinstance(p, AdamParams):
            raise TypeError(f"optimizer.params of type {self.type.value} is a {type(p).__name__}")
        return {
            "lr": p.lr,
            "betas": p.betas,
            "eps": p.eps,
            "weight_decay": p.weight_decay,
            "amsgrad": p.amsgrad,
        }

    def build(self, params: Iterable[Any]) -> Any:
        """Create the torch optimizer: ``torch.optim.AdamW``, ``Adam`` or ``SGD``.

        Args:
            params: Parameters or parameter groups, as for any torch optimizer.

        Returns:
            A ``torch.optim.Optimizer``. ``Adam`` with ``adam_w_mode`` (DeepSpeed's default)
            becomes ``torch.optim.AdamW``, as in DeepSpeed.

        Raises:
            ValueError: ``bias_correction = false``, which torch's Adam cannot do.
        """
        import torch  # lazily: the config itself needs only pydantic

        if isinstance(self.params, AdamParams) and not self.params.bias_correction:
            raise ValueError(
                "optimizer.params.bias_correction = false is not supported (torch's Adam always "
                "applies bias correction); remove the key"
            )
        if self.type is OptimizerType.SGD:
            cls = torch.optim.SGD
        else:
            cls = torch.optim.AdamW if self.decoupled_weight_decay else torch.optim.Adam
        return cls(params, **self.torch_kwargs())


# --------------------------------------------------------------------------- zero_optimization

_NVME = UsedWhen("`device` is `nvme`", lambda section, _: section.device is OffloadDevice.NVME)


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param`` (stage 3 only), DeepSpeed's defaults."""

    _PATH = ("zero_optimization", "offload_param")

    device: Annotated[Device, _USED] = OffloadDevice.NONE
    """``none``, ``cpu`` or ``nvme``."""
    nvme_path: Annotated[OptionalPath, Key(IMPLEMENTED, when=_NVME)] = None
    """Directory for swap files; required with ``nvme``."""
    buffer_count: Annotated[Int(0), _USED] = 5
    """Swap buffers for parameters."""
    buffer_size: Annotated[Int(0), _USED] = 100_000_000
    """Elements per swap buffer."""
    max_in_cpu: Annotated[Int(0), _USED] = 1_000_000_000
    """Elements of parameters kept in CPU memory with ``nvme``."""
    pin_memory: Annotated[Flag, _USED] = False
    """Page-locked CPU buffers (faster copies to an accelerator)."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadParamConfig:
        _require_nvme_path(self.device, self.nvme_path, "offload_param")
        return self

    @property
    def enabled(self) -> bool:
        """Whether parameters are offloaded (``device`` is not ``none``)."""
        return self.device is not OffloadDevice.NONE

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
            pin_memory=self.pin_memory,
        )


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer`` (stages 1-3), DeepSpeed's defaults.

    ``ratio`` < 1 (partial offload) is valid with stage 3 only, as in DeepSpeed.
    """

    _PATH = ("zero_optimization", "offload_optimizer")

    device: Annotated[Device, _USED] = OffloadDevice.NONE
    """``none``, ``cpu`` or ``nvme``."""
    nvme_path: Annotated[OptionalPath, Key(IMPLEMENTED, when=_NVME)] = None
    """Directory for swap files; required with ``nvme``."""
    buffer_count: Annotated[Int(0), _USED] = 4
    """Swap buffers for optimizer state."""
    pin_memory: Annotated[Flag, _USED] = False
    """Page-locked CPU buffers (faster copies to an accelerator)."""
    pipeline_read: Annotated[Flag, _USED] = False
    """Overlap reading swapped state with the step."""
    pipeline_write: Annotated[Flag, _USED] = False
    """Overlap writing swapped state with the step."""
    fast_init: Annotated[
        Flag, Key(Ignored("zero writes the initial swap files in one pass whatever this says"))
    ] = False
    """DeepSpeed: skip initialising swap files on creation."""
    ratio: Annotated[Real(0, 1), _USED] = 1.0
    """Fraction of each group's sub-groups whose optimizer step and state are offloaded (< 1: partial
    offload, stage 3 only; the rest is stepped on the device; the split is
    ``engine.optimizer.offload.offloaded_numel`` / ``device_numel``)."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadOptimizerConfig:
        _require_nvme_path(self.device, self.nvme_path, "offload_optimizer")
        return self

    @property
    def enabled(self) -> bool:
        """Whether optimizer state is offloaded (``device`` is not ``none``)."""
        return self.device is not OffloadDevice.NONE

    def to_offload_config(self, sub_group_size: int) -> OptimizerOffloadConfig | None:
        """This section as a ``zero_offload.OptimizerOffloadConfig`` (``None`` when not offloaded)."""
        from zero_offload import OffloadTarget, OptimizerOffloadConfig

        if not self.enabled:
            return None
        return OptimizerOffloadConfig(
            device=OffloadTarget(self.device.value),
            nvme_path=self.nvme_path,
            buffer_count=self.buffer_count,
            pin_memory=self.pin_memory,
            pipeline_read=self.pipeline_read,
            pipeline_write=self.pipeline_write,
            sub_group_size=sub_group_size,
            ratio=self.ratio,
        )


def _require_nvme_path(device: OffloadDevice, path: pathlib.Path | None, section: str) -> None:
    if device is OffloadDevice.NVME and path is None:
        raise ValueError(
            f"zero_optimization.{section}.device is 'nvme' but no nvme_path is given: add "
            f'"nvme_path": "/path/on/nvme" to zero_optimization.{section}'
        )


def _deprecated_offload(new: str) -> Rejected:
    return Rejected(f'a deprecated DeepSpeed key; use {{"{new}": {{"device": "cpu"}}}} instead')


class ZeroppLocoConfig(Section):
    """``zero_optimization.zeropp_loco_param``: error feedback of qgZ (DeepSpeed's names)."""

    _PATH = ("zero_optimization", "zeropp_loco_param")

    err_beta: Annotated[Real(0, 1, hi_open=True), _USED] = 0.8
    """Moving-average factor of the qgZ error buffer, in [0, 1): each reduction folds this rank's
    int4 quantization error into the buffer as ``e = err_beta * e + (1 - err_beta) * error`` and
    adds the buffer to the next gradient before quantizing it (0: classic error feedback)."""
    reset_T: Annotated[Int(1), _USED] = 1024  # noqa: N815 - DeepSpeed's key
    """Optimizer steps between resets of the qgZ error buffers to zero."""

    def to_feedback_config(self) -> ErrorFeedbackConfig:
        """This section as a ``zero_comm.ErrorFeedbackConfig``."""
        from zero_comm.qgz_feedback import ErrorFeedbackConfig

        return ErrorFeedbackConfig(err_beta=float(self.err_beta), reset_t=int(self.reset_T))


def _stage3(status: Refused | Ignored | None = None, default_text: str | None = None) -> Key:
    """The declaration of a stage-3 knob (implemented unless ``status`` says otherwise)."""
    return Key(status or IMPLEMENTED, stages=_STAGE3, default_text=default_text)


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

    stage: Annotated[Int(0, 3), _USED] = 0
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
    reduce_bucket_size: Annotated[Int(1), _USED] = 500_000_000
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
    allgather_bucket_size: Annotated[Int(1), Key(IMPLEMENTED, stages=_STAGE12)] = 500_000_000
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
    sub_group_size: Annotated[Int(1), _USED] = 1_000_000_000
    """Every stage: elements of a flat optimizer partition stepped at once (and, with
    `offload_optimizer`, swapped at once). The optimizer's temporaries (e.g. AdamW's
    per-element intermediates, up to ~2 fp32 tensors of this size) are bounded by it, not by
    the model; smaller values cost more Python calls per step."""
    load_from_fp32_weights: Annotated[
        Flag, Key(Refused("master weights from 16-bit copies", supported=True))
    ] = True
    """Load the fp32 master weights from a checkpoint's fp32 copies (``false``: from the 16-bit ones)."""
    ignore_unused_parameters: Annotated[Flag, Key(Refused("error on unused parameters", supported=True))] = (
        True
    )
    """Let parameters receive no gradient in a step (``false``: fail when one does not)."""
    prefetch_bucket_size: Annotated[Int(0), _stage3()] = 50_000_000
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
    max_live_parameters: Annotated[Int(0), _stage3()] = 1_000_000_000
    """Bound on gathered or in-flight elements that prefetching and reuse may keep alive (the
    running module's parameters are always gathered)."""
    max_reuse_distance: Annotated[Int(0), _stage3()] = 1_000_000_000
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
