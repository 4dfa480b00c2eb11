"""The recorded execution order of one kind of step, and what it tells prefetch and release."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from zero_coord.config import Phase, TraceState

__all__ = ["Trace", "TraceEvent"]


class TraceEvent(NamedTuple):
    """One module fetch in a trace: the module's qualified name and the pass it ran in."""

    module: str
    backward: bool

    def describe(self) -> str:
        """``'layers.3' (forward)`` style text for log lines."""
        return f"{self.module or '<root>'!r} ({'backward' if self.backward else 'forward'})"


class Trace:
    """Order in which hooked modules fetched their parameters during one kind of step.

    The first step of a phase records (``RECORD``); at its end the trace becomes
    ``COMPLETE`` and later steps are validated against it, event by event, and prefetched
    from it. A step that diverges makes it ``INVALID`` (logged once per trace) and the next
    step records again. An invalid or recording trace costs only prefetching: results are
    the same.

    Events are stored as ints, ``2 * module_index + backward``, so the hot path validates
    with one list lookup; :attr:`events` renders them.

    Args:
        phase: Phase of the steps this trace describes.
        root: Qualified name of the module whose forward starts these steps.
        module_names: Qualified names of the coordinator's hooked modules, by index.
    """

    __slots__ = (
        "_codes",
        "_cum_numel",
        "_event_slots",
        "_module_names",
        "_state",
        "_uses",
        "invalidations",
        "last_invalidation",
        "phase",
        "root",
    )

    def __init__(self, phase: Phase, root: str, module_names: Sequence[str]) -> None:
        self.phase = phase
        self.root = root
        self._module_names = module_names
        self._state = TraceState.RECORD
        self._codes: list[int] = []
        # Filled by complete():
        self._event_slots: list[tuple] = []
        self._cum_numel: list[int] = []
        self._uses: dict[int, tuple[int, ...]] = {}
        self.invalidations = 0
        self.last_invalidation: str | None = None

    def __repr__(self) -> str:
        return (
            f"Trace(phase={self.phase.name}, root={self.root!r}, state={self._state.name}, "
            f"events={len(self)})"
        )

    def __len__(self) -> int:
        return len(self._codes)

    @property
    def state(self) -> TraceState:
        """``RECORD``, ``COMPLETE`` or ``INVALID``."""
        return self._state

    @property
    def events(self) -> tuple[TraceEvent, ...]:
        """The recorded (or, while recording, the so far recorded) module fetches, in order."""
        return tuple(self.describe_code(code) for code in self._codes)

    def describe_code(self, code: int) -> TraceEvent:
        """Turn an event code back into a :class:`TraceEvent`."""
        return TraceEvent(self._module_names[code >> 1], bool(code & 1))

    # --- used by the coordinator ------------------------------------------------------

    def begin_step(self) -> bool:
        """Prepare for a step; returns True when the step validates against a complete trace."""
        if self._state is TraceState.COMPLETE:
            return True
        self._state = TraceState.RECORD
        self._codes.clear()
        self._event_slots = []
        self._cum_numel = []
        self._uses = {}
        return False

    def complete(self, module_slots: Sequence[tuple]) -> None:
        """Freeze the recorded events and precompute what prefetch and release look up.

        Args:
            module_slots: The parameter slots of each hooked module, by module index. Each
                slot has ``index`` and ``numel``.
        """
        event_slots = [module_slots[code >> 1] for code in self._codes]
        cum = [0]
        uses: dict[int, list[int]] = {}
        for pos, slots in enumerate(event_slots):
            cum.append(cum[-1] + sum(s.numel for s in slots))
            for s in slots:
                uses.setdefault(s.index, []).append(pos)
        self._event_slots = event_slots
        self._cum_numel = cum
        self._uses = {index: tuple(positions) for index, positions in uses.items()}
        self._state = TraceState.COMPLETE

    def invalidate(self, reason: str | None) -> bool:
        """Drop the trace; returns True when this is its first invalidation (log it)."""
        self._state = TraceState.INVALID
        self._event_slots = []
        self._cum_numel = []
        self._uses = {}
        if reason is None:
            return False
        self.invalidations += 1
        self.last_invalidation = reason
        return self.invalidations == 1
