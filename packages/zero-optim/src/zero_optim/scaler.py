"""fp16 loss scaling (DeepSpeed semantics) and the cross-rank overflow check.

:class:`LossScaler` holds the scale. Static (``loss_scale > 0``): the scale never changes,
but an overflowing step is still skipped. Dynamic (``loss_scale == 0``, DeepSpeed's
``DynamicLossScaler``): start at ``2**initial_scale_power``; on an overflow, if the
hysteresis budget is spent (``hysteresis`` overflows absorbed) the scale halves, never
below ``min_loss_scale``, else the budget shrinks by one; after ``loss_scale_window``
overflow-free steps since the last overflow the scale doubles and the budget refills
(with ``consecutive_hysteresis`` every overflow-free step refills it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import zero_comm
from zero_comm.profiling import profile_range
from zero_optim.flat import FlatGroup

__all__ = ["LossScaler", "LossScalerConfig", "found_overflow"]


@dataclasses.dataclass(frozen=True)
class LossScalerConfig:
    """DeepSpeed's ``fp16`` section numbers."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_scale < 0 or not math.isfinite(self.loss_scale):
            raise ValueError(f"loss_scale must be 0 (dynamic) or a positive number, got {self.loss_scale}")
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ValueError(f"LossScalerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.min_loss_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {self.min_loss_scale}")
        if self.initial_scale_power < 0:
            raise ValueError(f"initial_scale_power must be >= 0, got {self.initial_scale_power}")


class LossScaler:
    """The loss scale and its update rule (see the module docstring).

    Args:
        config: Static or dynamic scaling settings.

    Attributes:
        scale: The current scale (multiply the loss by it; divide the gradients by it).
        skipped_steps: Steps skipped because of an overflow.
    """

    __slots__ = ("_hysteresis", "_iter", "_last_overflow", "config", "scale", "skipped_steps")

    def __init__(self, config: LossScalerConfig = LossScalerConfig()) -> None:  # noqa: B008 - frozen
        self.config = config
        self.scale = float(config.loss_scale if self.dynamic is False else 2.0**config.initial_scale_power)
        self._hysteresis = config.hysteresis
        self._iter = 0
        self._last_overflow = -1
        self.skipped_steps = 0

    @property
    def dynamic(self) -> bool:
        """Whether the scale adapts (``loss_scale == 0``)."""
        return self.config.loss_scale == 0

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step that did (skipped) or did not overflow."""
        cfg = self.config
        if overflow:
            self.skipped_steps += 1
        if not self.dynamic:
            self._iter += 1
            return
        if overflow:
            if cfg.hysteresis == 1 or self._hysteresis == 1:
                self.scale = max(self.scale / 2.0, cfg.min_loss_scale)
            else:
                self._hysteresis -= 1
            self._last_overflow = self._iter
        else:
            if cfg.consecutive_hysteresis:
                self._hysteresis = cfg.hysteresis
            if (self._iter - self._last_overflow) % cfg.loss_scale_window == 0:
                if not cfg.consecutive_hysteresis:
                    self._hysteresis = cfg.hysteresis
                self.scale *= 2.0
        self._iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume scaling exactly."""
        return {
            "scale": self.scale,
            "hysteresis": self._hysteresis,
            "iter": self._iter,
            "last_overflow": self._last_overflow,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self._hysteresis = int(state["hysteresis"])
        self._iter = int(state["iter"])
        self._last_overflow = int(state["last_overflow"])
        self.skipped_steps = int(state["skipped_steps"])


def found_overflow(groups: Sequence[FlatGroup], group: ProcessGroup | None = None) -> bool:
    """Whether any rank's gradient partitions hold an inf or nan: one all-reduce (max) of a flag.

    One ``torch.aminmax`` pass over each gradient tensor (the flat partition, or each view of a
    partition made of views: stage 1's in-place gradients), then one ``isfinite`` over all the
    extremes and one read of the flag, after the all-reduce. Every rank of ``group`` must call
    it; all of them get the same answer.
    """
    with profile_range("zero.optim.overflow_check"):
        extremes = [e for g in groups for grad in g.grads() for e in torch.aminmax(grad)]
        device = groups[0].grad.device if groups else zero_comm.control_device(group)
        if extremes:  # aminmax propagates nan, and an inf is the minimum or the maximum
            flag = torch.isfinite(torch.stack(extremes)).all().logical_not().to(torch.float32).reshape(1)
        else:
            flag = torch.zeros(1, device=device)

        if dist.is_available() and dist.is_initialized():
            if flag.device.type not in zero_comm.served_device_types(group):  # host-resident partitions
                flag = flag.to(zero_comm.control_device(group))
            zero_comm.all_reduce(flag, group, op="max")
        return bool(flag.item() > 0)
