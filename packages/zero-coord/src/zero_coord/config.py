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

    Attributes:
        prefetch_bucket_size: How many elements of upcoming modules' parameters may be in
            flight or gathered ahead of use (``stage3_prefetch_bucket_size``). ``0`` turns
            prefetching off. A window of modules is gathered with one collective once half
            the bucket is free, so larger buckets mean fewer, larger all-gathers.
        max_live_parameters: Upper bound on gathered (or in-flight) parameter elements that
            prefetching and reuse may keep alive (``stage3_max_live_parameters``). The
            parameters a running module needs are always gathered, and when nothing is
            prefetched the next module is (a module larger than the bound, such as a tied
            embedding and head, still has the next one in flight), so the peak is at most this
            bound plus the parameters of the modules running at once; a module larger than the
            bound is itself prefetched only with nothing else ahead and everything else within
            the bound, so the peak is then at most the bound plus that module.
            Under the bound, parameters kept for reuse that are needed later make room for
            prefetches needed sooner.
        max_reuse_distance: A parameter whose next use in the recorded trace is at most
            this many gathered elements away stays gathered after its module finishes
            (``stage3_max_reuse_distance``); ``0`` keeps only parameters that are used again
            by the very next module. A parameter whose next use lies inside the window
            prefetching already covered also stays (it counts as prefetched).
        module_granularity_threshold: Modules whose subtree holds at most this many
            parameter elements per layer are gathered as one leaf
            (``stage3_module_granularity_threshold``; see
            :func:`~zero_coord.leaf.granularity_leaves`): one gather and one pair of hooks
            for a block of small modules instead of one per module, at the price of the
            whole block being gathered at once. ``0`` (the default) turns it off.
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
