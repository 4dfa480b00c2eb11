"""What a checkpoint saves and restores, handed over by the engine: :class:`TrainState`."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from torch import nn

from zero_full.config.zero_config import ZeroConfig
from zero_full.wiring.mics import MicsGroups
from zero_optim import LossScaler, PartitionedOptimizer

__all__ = ["LRSchedulerLike", "StepCounters", "TrainState"]


class LRSchedulerLike(Protocol):
    """What a checkpoint needs of an LR scheduler (every ``torch.optim.lr_scheduler`` has it)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class StepCounters:
    """The training loop's counters (the engine's, restored by a checkpoint load)."""

    gradient_accumulation_steps: int
    micro_steps: int = 0
    global_steps: int = 0

    def restore(self, global_steps: int, micro_steps: int, saved_accumulation_steps: int) -> None:
        """Set the counters of a loaded checkpoint.

        ``micro_steps`` is taken as saved when the accumulation steps are unchanged, else
        recomputed from ``global_steps`` (the saved micro-steps count other micro-batches).
        """
        self.global_steps = global_steps
        if saved_accumulation_steps == self.gradient_accumulation_steps:
            self.micro_steps = micro_steps
        else:
            self.micro_steps = global_steps * self.gradient_accumulation_steps


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything of a training run a checkpoint touches, owned by the engine and passed in.

    Every field is given: ``None`` says the run has no loss scaler (not fp16), no MiCS groups or
    no LR scheduler."""

    module: nn.Module
    optimizer: PartitionedOptimizer
    config: ZeroConfig
    counters: StepCounters
    scaler: LossScaler | None
    mics: MicsGroups | None
    lr_scheduler: LRSchedulerLike | None

    @property
    def timeout(self) -> float:
        """Seconds a rank waits for the others at a checkpoint collective (``robustness.comm_timeout``)."""
        return float(self.config.robustness.comm_timeout)
