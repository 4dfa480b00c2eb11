"""``scheduler``: DeepSpeed's learning-rate schedules, ``{"type": "WarmupLR", "params": {...}}``.

The five types and their parameter names and defaults are DeepSpeed's
(``deepspeed.runtime.lr_schedules``); ``params`` is checked per type. The schedule is built by
:func:`zero_full.wiring.schedulers.build_scheduler` over the engine's torch optimizer and
stepped once per optimizer step (at gradient-accumulation boundaries), as DeepSpeed does.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

from pydantic import model_validator

from zero_full.config.base import Section, TypedSection
from zero_full.config.types import (
    IMPLEMENTED,
    USED,
    Choice,
    Flag,
    Int,
    Key,
    OptionalPerGroup,
    PerGroup,
    Real,
    UsedWhen,
)

__all__ = [
    "LRRangeTestParams",
    "OneCycleParams",
    "SchedulerConfig",
    "SchedulerType",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "WarmupType",
]


class SchedulerType(str, enum.Enum):
    """The schedules the ``scheduler`` section can describe (``type`` is case-insensitive)."""

    WARMUP_LR = "WarmupLR"
    WARMUP_DECAY_LR = "WarmupDecayLR"
    WARMUP_COSINE_LR = "WarmupCosineLR"
    ONE_CYCLE = "OneCycle"
    LR_RANGE_TEST = "LRRangeTest"


class WarmupType(str, enum.Enum):
    """How the warm-up rises from its start to its end."""

    LOG = "log"
    LINEAR = "linear"


_PATH = ("scheduler", "params")


class WarmupLRParams(Section):
    """``scheduler.params`` of ``WarmupLR``: rise from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    At optimizer step ``t`` (0 at the first ``step()``) the rise is ``log(t + 1) / log(n)``
    (``log``) or ``t / n`` (``linear``) of the way, with ``n = max(2, warmup_num_steps)``.
    """

    _PATH = _PATH

    warmup_min_lr: Annotated[PerGroup, USED] = 0.0
    """Learning rate at the start of the warm-up (one number, or one per parameter group)."""
    warmup_max_lr: Annotated[OptionalPerGroup, USED] = None
    """Learning rate at the end of the warm-up (``null``: each group's learning rate of the
    optimizer, as DeepSpeed 0.19 does)."""
    warmup_num_steps: Annotated[Int(1), USED] = 1000
    """Optimizer steps of the warm-up (at least 2 are used)."""
    warmup_type: Annotated[Choice(WarmupType), USED] = WarmupType.LOG
    """``log`` or ``linear`` rise."""
    last_batch_iteration: Annotated[Int(-1), USED] = -1
    """The index of the last step already taken; -1 starts the schedule from its beginning."""


class WarmupDecayLRParams(WarmupLRParams):
    """``scheduler.params`` of ``WarmupDecayLR``: warm-up, then linear decay to 0 at ``total_num_steps``."""

    warmup_max_lr: Annotated[OptionalPerGroup, USED] = 0.001
    """Learning rate at the end of the warm-up (DeepSpeed's default for this type: 0.001)."""
    total_num_steps: Annotated[Int(1), USED]
    """Optimizer steps of the whole schedule; the learning rate reaches 0 there."""


class WarmupCosineLRParams(Section):
    """``scheduler.params`` of ``WarmupCosineLR``: a ratio of the optimizer's learning rate.

    The ratio rises from ``warmup_min_ratio`` to 1 over the warm-up (``log`` or ``linear``),
    then follows a half cosine down to ``cos_min_ratio`` at ``total_num_steps`` and stays there.
    """

    _PATH = _PATH

    total_num_steps: Annotated[Int(1), USED]
    """Optimizer steps of the whole schedule."""
    warmup_min_ratio: Annotated[Real(0), USED] = 0.0
    """Ratio of the learning rate at the start of the warm-up."""
    warmup_num_steps: Annotated[Int(1), USED] = 1000
    """Optimizer steps of the warm-up (at least 2 are used)."""
    cos_min_ratio: Annotated[Real(0), USED] = 0.0001
    """Ratio of the learning rate at the end of the cosine."""
    warmup_type: Annotated[Choice(WarmupType), USED] = WarmupType.LOG
    """``log`` or ``linear`` rise."""
    last_batch_iteration: Annotated[Int(-1), USED] = -1
    """The index of the last step already taken; -1 starts the schedule from its beginning."""


_CYCLES_MOMENTUM = UsedWhen("`cycle_momentum` is true", lambda params, _: params.cycle_momentum)


class OneCycleParams(Section):
    """``scheduler.params`` of ``OneCycle``: one triangular cycle of the learning rate (and, inversely,
    of ``beta1``), then an optional decay.
    """

    _PATH = _PATH

    cycle_min_lr: Annotated[PerGroup, USED]
    """Learning rate at the start and end of the cycle."""
    cycle_max_lr: Annotated[PerGroup, USED]
    """Learning rate at the peak of the cycle."""
    decay_lr_rate: Annotated[Real(0), USED] = 0.0
    """Decay rate of the learning rate after the cycle (0: none)."""
    cycle_first_step_size: Annotated[Int(1), USED] = 2000
    """Optimizer steps of the rising half."""
    cycle_second_step_size: Annotated[Int(0, none_ok=True), USED] = None
    """Optimizer steps of the falling half (``null``: ``cycle_first_step_size``)."""
    cycle_first_stair_count: Annotated[Int(0), USED] = 0
    """Stairs of the rising half (0: continuous)."""
    cycle_second_stair_count: Annotated[Int(0, none_ok=True), USED] = None
    """Stairs of the falling half (``null``: ``cycle_first_stair_count``)."""
    decay_step_size: Annotated[Int(0), USED] = 0
    """Steps per decay interval after the cycle (0: no decay)."""
    cycle_momentum: Annotated[Flag, USED] = True
    """Cycle ``beta1`` inversely to the learning rate (optimizers with ``betas`` only)."""
    cycle_min_mom: Annotated[PerGroup, Key(IMPLEMENTED, when=_CYCLES_MOMENTUM)] = 0.8
    """``beta1`` at the peak of the learning rate."""
    cycle_max_mom: Annotated[PerGroup, Key(IMPLEMENTED, when=_CYCLES_MOMENTUM)] = 0.9
    """``beta1`` at the start and end of the cycle."""
    decay_mom_rate: Annotated[Real(0), Key(IMPLEMENTED, when=_CYCLES_MOMENTUM)] = 0.0
    """Growth rate of ``beta1`` after the cycle (0: none)."""
    last_batch_iteration: Annotated[Int(-1), USED] = -1
    """The index of the last step already taken; -1 starts the schedule from its beginning."""

    @model_validator(mode="after")
    def _min_below_max(self) -> OneCycleParams:
        for low_key, high_key in (("cycle_min_lr", "cycle_max_lr"), ("cycle_min_mom", "cycle_max_mom")):
            low, high = getattr(self, low_key), getattr(self, high_key)
            if isinstance(low, tuple) != isinstance(high, tuple) or (
                isinstance(low, tuple) and len(low) != len(high)
            ):
                raise ValueError(
                    f"scheduler.params.{low_key} = {low!r} and {high_key} = {high!r}: give both as "
                    "numbers, or both as lists of one value per parameter group"
                )
        return self


class LRRangeTestParams(Section):
    """``scheduler.params`` of ``LRRangeTest``: the learning rate grows from ``lr_range_test_min_lr``
    by ``1 + lr_range_test_step_rate * (t + 1) / lr_range_test_step_size`` (floored with staircase)."""

    _PATH = _PATH

    lr_range_test_min_lr: Annotated[PerGroup, USED] = 0.001
    """Learning rate at the start."""
    lr_range_test_step_size: Annotated[Int(1), USED] = 2000
    """Optimizer steps per interval of growth."""
    lr_range_test_step_rate: Annotated[Real(0), USED] = 1.0
    """Growth per interval."""
    lr_range_test_staircase: Annotated[Flag, USED] = False
    """Grow in whole intervals (stairs) instead of continuously."""
    last_batch_iteration: Annotated[Int(-1), USED] = -1
    """The index of the last step already taken; -1 starts the schedule from its beginning."""


_PARAMS_BY_TYPE: dict[SchedulerType, type[Section]] = {
    SchedulerType.WARMUP_LR: WarmupLRParams,
    SchedulerType.WARMUP_DECAY_LR: WarmupDecayLRParams,
    SchedulerType.WARMUP_COSINE_LR: WarmupCosineLRParams,
    SchedulerType.ONE_CYCLE: OneCycleParams,
    SchedulerType.LR_RANGE_TEST: LRRangeTestParams,
}


class SchedulerConfig(TypedSection):
    """``scheduler``: ``{"type": "WarmupLR", "params": {...}}``; ``params`` is checked per type.

    Stepped once per optimizer step (at gradient-accumulation boundaries) by the engine, and
    saved in its checkpoints. A schedule passed to ``initialize`` takes the place of this section.
    """

    _PATH = ("scheduler",)
    _TYPES = SchedulerType
    _PARAMS_BY_TYPE: ClassVar[dict[SchedulerType, type[Section]]] = _PARAMS_BY_TYPE

    type: Annotated[Choice(SchedulerType), USED]
    """``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` or ``LRRangeTest``, any case
    (DeepSpeed's schedules; for a torch schedule, pass it to ``initialize``)."""
    params: Annotated[
        WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | OneCycleParams | LRRangeTestParams,
        USED,
    ]
    """The schedule's keyword arguments, checked for its ``type`` (tables below)."""
