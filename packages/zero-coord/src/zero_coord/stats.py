"""Per-step statistics of the coordinator: gathers, prefetch hits, peak live elements."""

from __future__ import annotations

import dataclasses

from zero_coord.config import Phase

__all__ = ["StepStats"]


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step (or, summed, every closed step) cost in parameter traffic.

    Counts are per parameter use unless said otherwise.
    """

    phase: Phase | None = None
    steps: int = 0
    max_live_elements: int = 0
    gathers: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    reuse_hits: int = 0
    bytes_gathered: int = 0
    trace_invalidations: int = 0
    shard_prefetches: int = 0

    @property
    def prefetch_hit_rate(self) -> float:
        """``prefetch_hits / (prefetch_hits + prefetch_misses)`` (1.0 when nothing was gathered)."""
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 1.0

    def __add__(self, other: StepStats) -> StepStats:
        """Running total of two stats (phase dropped, peaks maxed, counts summed)."""
        counts = {name: getattr(self, name) + getattr(other, name) for name in _COUNTERS}
        counts["max_live_elements"] = max(self.max_live_elements, other.max_live_elements)
        return StepStats(phase=None, steps=self.steps + other.steps, **counts)


# The per-step counters of StepStats (every field but the phase and the step count).
_COUNTERS = tuple(f.name for f in dataclasses.fields(StepStats) if f.name not in ("phase", "steps"))


class StatsAccumulator:
    """Mutable counters of the step in progress; :meth:`close` turns them into a :class:`StepStats`.

    It has one attribute per counter of :class:`StepStats` (``gathers``, ``prefetch_hits``, ...).
    """

    __slots__ = _COUNTERS

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        for name in _COUNTERS:
            setattr(self, name, 0)

    def close(self, phase: Phase | None, live_elements: int) -> StepStats:
        """Snapshot the counters as one step and start the next one from ``live_elements``."""
        stats = StepStats(phase=phase, steps=1, **{name: getattr(self, name) for name in _COUNTERS})
        self.reset()
        self.max_live_elements = live_elements
        return stats
