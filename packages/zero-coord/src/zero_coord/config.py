"""Configuration and the small enums of the coordinator."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["CoordinatorConfig", "Phase", "TraceState"]


class Phase(enum.Enum):
    """Which kind of step a trace belongs to.

    ``TRAIN`` steps run with autograd enabled on a model in training mode and end when
    backward finishes; ``EVAL`` steps (``torch.no_grad()``, ``torch.inference_mode()`` or
    ``model.eval()``) end when the root module's forward returns. Each phase keeps its own
    trace, so alternating training and evaluation does not invalidate either.
    """

    TRAIN = "train"
    EVAL = "eval"


class TraceState(enum.Enum):
    """Life cycle of a :class:`~zero_coord.Trace`.

    ``RECORD``: the current (or next) step records the module order. ``COMPLETE``: a full
    step was recorded and later steps are validated against it and prefetched from it.
    ``INVALID``: a step diverged from the recorded order; the next step records again.
    """

    RECORD = "record"
    COMPLETE = "complete"
    INVALID = "invalid"


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """Fetch / prefetch / release policy of the coordinator (sizes in elements).

    ``zero_full``'s configuration maps DeepSpeed's keys onto these fields.
    """

    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    module_granularity_threshold: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"CoordinatorConfig.{field.name} must be a non-negative int (elements), got {value!r}"
                )
