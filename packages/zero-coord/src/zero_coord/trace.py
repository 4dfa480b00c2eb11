"""The recorded execution order of one kind of step, and what it tells prefetch and release."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, Protocol

from zero_coord.config import Phase, TraceState

__all__ = ["PlannedSlot", "Trace", "TraceEvent", "TracePlan"]


class TraceEvent(NamedTuple):
    """One module fetch in a trace: the module's qualified name and the pass it ran in."""

    module: str
    backward: bool

    def describe(self) -> str:
        """``'layers.3' (forward)`` style text for log lines."""
        return f"{self.module or '<root>'!r} ({'backward' if self.backward else 'forward'})"


class PlannedSlot(Protocol):
    """What a plan needs of a parameter slot (:class:`zero_coord.slots.ParamSlot` has it)."""

    @property
    def index(self) -> int:
        """Position of the slot in the coordinator's slot list."""
        ...

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        ...


@dataclasses.dataclass(frozen=True)
class TracePlan:
    """A complete trace, frozen: the order to match later steps against and what prefetch and
    release look up in it.
    """

    codes: tuple[int, ...]
    event_slots: tuple[tuple[PlannedSlot, ...], ...]
    cum_numel: tuple[int, ...]
    event_numel: tuple[int, ...]
    uses: Mapping[int, tuple[int, ...]]

    @classmethod
    def build(cls, codes: Sequence[int], module_slots: Sequence[tuple[PlannedSlot, ...]]) -> TracePlan:
        """Plan ``codes`` given the parameter slots of each hooked module, by module index."""
        event_slots = tuple(module_slots[code >> 1] for code in codes)
        numel = tuple(sum(s.numel for s in slots) for slots in event_slots)
        cum = [0]
        uses: dict[int, list[int]] = {}
        for pos, slots in enumerate(event_slots):
            cum.append(cum[-1] + numel[pos])
            for s in slots:
                uses.setdefault(s.index, []).append(pos)
        frozen_uses = MappingProxyType({index: tuple(positions) for index, positions in uses.items()})
        return cls(tuple(codes), event_slots, tuple(cum), numel, frozen_uses)

    def __len__(self) -> int:
        return len(self.codes)

    def matches(self, cursor: int, code: int) -> bool:
        """Whether event ``code`` is the one recorded at position ``cursor``."""
        codes = self.codes
        return cursor < len(codes) and codes[cursor] == code

    def next_use(self, slot_index: int, cursor: int) -> int | None:
        """First position at or after ``cursor`` that fetches slot ``slot_index`` (``None``: none)."""
        positions = self.uses.get(slot_index, ())
        nxt = bisect.bisect_left(positions, cursor)
        return positions[nxt] if nxt < len(positions) else None


class Trace:
    """Order in which hooked modules fetched their parameters during one kind of step.

    The first step of a phase records (``RECORD``); at its end the trace becomes
    ``COMPLETE`` with a frozen :attr:`plan`, and later steps are matched against it, event by
    event, and prefetched from it. A step that diverges makes it ``INVALID`` (logged once per
    trace) and the next step records again. An invalid or recording trace costs only
    prefetching: results are the same.
    """

    __slots__ = (
        "_codes",
        "_module_names",
        "_plan",
        "_state",
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
        self._plan: TracePlan | None = None
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
    def plan(self) -> TracePlan | None:
        """The frozen plan while the trace is ``COMPLETE``, else ``None``."""
        return self._plan

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
        self._plan = None
        return False

    def record(self, code: int) -> None:
        """Append event ``code`` to the order being recorded."""
        if self._state is not TraceState.RECORD:
            raise RuntimeError(f"{self!r}.record(): only a recording trace records; call begin_step() first")
        self._codes.append(code)

    def complete(self, module_slots: Sequence[tuple[PlannedSlot, ...]]) -> None:
        """Freeze the recorded events into :attr:`plan`.

        Args:
            module_slots: The parameter slots of each hooked module, by module index.
        """
        self._plan = TracePlan.build(self._codes, module_slots)
        self._state = TraceState.COMPLETE

    def invalidate(self, reason: str | None) -> bool:
        """Drop the plan; returns True when this is the trace's first counted invalidation (log it).

        ``reason`` ``None``: dropped on request, not counted.
        """
        self._state = TraceState.INVALID
        self._plan = None
        if reason is None:
            return False
        self.invalidations += 1
        self.last_invalidation = reason
        return self.invalidations == 1

    # --- matching a live step against the plan -----------------------------------------

    def _expected(self, cursor: int) -> str | None:
        codes = self._codes
        return self.describe_code(codes[cursor]).describe() if cursor < len(codes) else None

    def divergence(self, cursor: int, code: int | None) -> str:
        """Log text for a step that ran event ``code`` (``None``: ended) at position ``cursor``."""
        expected = self._expected(cursor)
        where = f"{self.phase.name} trace of {self.root or '<root>'!r} (event {cursor} of {len(self)})"
        if code is None:
            what = f"the step ended where {expected} was expected next"
        elif expected is None:
            what = f"module {self.describe_code(code).describe()} ran after the recorded order ended"
        else:
            what = f"module {self.describe_code(code).describe()} ran where {expected} was expected"
        return f"{where} diverged: {what}"

    def departure(self, cursor: int, code: int | None) -> str:
        """The same departure for the collective watchdog (``zero_comm.watched.path_diverged``):
        ``runs `mid` (forward) where its recorded order has 'out' (forward)``."""
        expected = self._expected(cursor)
        has = f"its recorded order has {expected}" if expected is not None else "its recorded order ended"
        if code is None:
            return f"ends its step where {has} next"
        event = self.describe_code(code)
        runs = f"`{event.module or '<root>'}` ({'backward' if event.backward else 'forward'})"
        return f"runs {runs} where {has}"
