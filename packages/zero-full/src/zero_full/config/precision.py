"""``fp16`` and ``bf16``: the training precision and fp16's loss scaling (DeepSpeed's names and defaults)."""

from __future__ import annotations

from typing import Annotated

from zero_full.config.base import Section
from zero_full.config.types import IMPLEMENTED, USED, Flag, Int, Key, Real, Refused, UsedWhen

__all__ = ["BF16Config", "FP16Config"]


_FP16_ON = UsedWhen("fp16 is enabled", lambda fp16, _: fp16.enabled)
_DYNAMIC = UsedWhen(
    "fp16 is enabled with dynamic loss scaling (`loss_scale` 0)",
    lambda fp16, _: fp16.enabled and fp16.dynamic_loss_scale,
)


class FP16Config(Section):
    """``fp16``: half precision with loss scaling (DeepSpeed's names and defaults)."""

    _PATH = ("fp16",)

    enabled: Annotated[Flag, USED] = False
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

    enabled: Annotated[Flag, USED] = False
    """Train in bfloat16 (working copies of parameters and gradients in bf16, fp32 master weights
    and optimizer state); no loss scaling."""
