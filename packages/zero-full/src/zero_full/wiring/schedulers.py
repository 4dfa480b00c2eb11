"""DeepSpeed's learning-rate schedules as torch ``LRScheduler`` objects, from the ``scheduler`` section."""

from __future__ import annotations

import abc
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zero_full.config.scheduler import (
    LRRangeTestParams,
    OneCycleParams,
    SchedulerType,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    WarmupType,
)
from zero_full.config.zero_config import ZeroConfig

__all__ = [
    "DeepSpeedSchedule",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

Betas = tuple[float, float]


def _per_group(optimizer: torch.optim.Optimizer, value: float | Sequence[float], key: str) -> list[float]:
    """``value`` for every parameter group: a number repeated, or a list with one per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != groups:
            raise ValueError(
                f"scheduler.params.{key} has {len(value)} values but the optimizer has {groups} parameter "
                f"groups; give one number, or one value per group"
            )
        return list(value)
    return [value] * groups


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> list[Any]:
    """Write ``lrs`` into the parameter groups (a tensor learning rate is filled in place)."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class DeepSpeedSchedule(LRScheduler, metaclass=abc.ABCMeta):
    """Base of the five schedules: the learning rate of iteration ``t`` is :meth:`lrs_at` ``(t)``.

    Attributes:
        optimizer: The torch optimizer whose parameter groups are set.
        last_batch_iteration: The iteration whose learning rate is set (-1 before the first step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"a learning-rate schedule needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self._last_lr = list(self.base_lrs)

    def _start(self) -> None:
        """Set the values of iteration -1 (called at construction when the schedule starts)."""
        self._last_lr = _set_lrs(self.optimizer, self.lrs_at(-1))

    @abc.abstractmethod
    def lrs_at(self, iteration: int) -> list[float]:
        """The learning rate of every parameter group at ``iteration``."""

    def betas_at(self, iteration: int) -> list[Betas] | None:
        """Every group's ``betas`` at ``iteration`` (``None``: the schedule leaves them alone)."""
        return None

    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        """torch's name of :attr:`last_batch_iteration`."""
        return self.last_batch_iteration

    def get_lr(self) -> list[float]:
        """The learning rates of the current iteration."""
        return self.lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The learning rates last set."""
        return self._last_lr

    def step(self, batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance to the next iteration (or to ``batch_iteration``) and set its values."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if batch_iteration is None else batch_iteration
        )
        self._apply()

    def _apply(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.lrs_at(self.last_batch_iteration))
        betas = self.betas_at(self.last_batch_iteration)
        if betas is not None:
            for group, value in zip(self.optimizer.param_groups, betas, strict=True):
                group["betas"] = value

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's state of a schedule: ``{"last_batch_iteration": t}``."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved iteration, and set its values (a fresh optimizer then runs on alike)."""
        if "last_batch_iteration" not in state_dict:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: the state has no 'last_batch_iteration' "
                f"(keys: {sorted(state_dict)}); it is not a state of a DeepSpeed-style schedule"
            )
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        if self.last_batch_iteration >= 0:
            self._apply()


class LRRangeTest(DeepSpeedSchedule):
    """DeepSpeed's ``LRRangeTest``: ``min_lr * (1 + step_rate * (t + 1) / step_size)`` , floored by stairs."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(
                f"scheduler.params.lr_range_test_step_size must be > 0, got {lr_range_test_step_size}"
            )
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.min_lr)

    def lrs_at(self, iteration: int) -> list[float]:
        interval = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [min_lr * increase for min_lr in self.min_lr]


class _WarmupSchedule(DeepSpeedSchedule):
    """A schedule that starts with DeepSpeed's warm-up: ``log`` or ``linear``, over at least 2 steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_num_steps: int,
        warmup_type: str,
        last_batch_iteration: int,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_num_steps <= 0:
            raise ValueError(f"scheduler.params.warmup_num_steps must be > 0, got {warmup_num_steps}")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = WarmupType(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_gamma(self, iteration: int) -> float:
        """How far the warm-up has risen at ``iteration`` (0 at the start, 1 at its end)."""
        if self.warmup_type is WarmupType.LOG:
            return self.inverse_log_warm_up * math.log(iteration + 1)
        return iteration / self.warmup_num_steps


class WarmupLR(_WarmupSchedule):
    """DeepSpeed's ``WarmupLR``: ``min + (max - min) * gamma(t)``, gamma rising to 1 over the warm-up."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WarmupType.LOG.value,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=True)]
        if last_batch_iteration == -1:
            self._start()

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [
            min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs, strict=True)
        ]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's ``WarmupDecayLR``: ``WarmupLR``, then linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WarmupType.LOG.value,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        return max(
            0.0,
            float(self.total_num_steps - iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_WarmupSchedule):
    """DeepSpeed's ``WarmupCosineLR``: the optimizer's learning rate times a warm-up, then cosine, ratio."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WarmupType.LOG.value,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_min_ratio = warmup_min_ratio
        self.org_lrs = [lr.clone() if torch.is_tensor(lr) else lr for lr in self.base_lrs]
        if last_batch_iteration == -1:
            self._start()

    def lr_ratio(self, iteration: int) -> float:
        """The factor of the optimizer's learning rate at ``iteration``."""
        if iteration < self.warmup_num_steps:
            ratio = self._warmup_gamma(iteration)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.lr_ratio(iteration)
        return [org_lr * ratio for org_lr in self.org_lrs]


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's ``OneCycle``: a triangular cycle of the learning rate and, inversely, of ``beta1``.

    As in DeepSpeed, a cycled ``betas`` pair is ``(beta1, 0.99)``, and the schedule starts with
    ``beta1 = cycle_min_mom``. Optimizers without ``betas`` keep their momentum (a warning says so).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError(
                "scheduler.params.cycle_first_step_size must be > 0 and cycle_second_step_size >= 0, got "
                f"{cycle_first_step_size} and {cycle_second_step_size}"
            )
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(
                f"scheduler OneCycle: cycle_momentum is off because {type(optimizer).__name__} has no betas",
                stacklevel=2,
            )
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            _set_lrs(optimizer, self.min_lrs)
            if self.cycle_momentum:
                for momentum, group in zip(self.min_moms, optimizer.param_groups, strict=True):
                    group["betas"] = momentum

    def _scale_factor(self, iteration: int) -> float:
        batch_iteration = iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def betas_at(self, iteration: int) -> list[Betas] | None:
        if not self.cycle_momentum:
            return None
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [
                (hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(beta0 * factor, beta1) for beta0, beta1 in self.max_moms]


_CLASSES: dict[SchedulerType, type[DeepSpeedSchedule]] = {
    SchedulerType.WARMUP_LR: WarmupLR,
    SchedulerType.WARMUP_DECAY_LR: WarmupDecayLR,
    SchedulerType.WARMUP_COSINE_LR: WarmupCosineLR,
    SchedulerType.ONE_CYCLE: OneCycle,
    SchedulerType.LR_RANGE_TEST: LRRangeTest,
}
_PARAMS = (WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams, OneCycleParams, LRRangeTestParams)


def _kwargs(params: Any) -> dict[str, Any]:
    if not isinstance(params, _PARAMS):
        raise TypeError(f"scheduler.params is a {type(params).__name__}, not a schedule's parameters")
    out = {}
    for name in type(params).model_fields:
        value = getattr(params, name)
        out[name] = value.value if isinstance(value, WarmupType) else value
    return out


def build_scheduler(config: ZeroConfig, optimizer: torch.optim.Optimizer) -> DeepSpeedSchedule | None:
    """The schedule the ``scheduler`` section describes, over ``optimizer`` (``None`` without the section)."""
    section = config.scheduler
    if section is None:
        return None
    return _CLASSES[section.type](optimizer, **_kwargs(section.params))
