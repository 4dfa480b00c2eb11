"""How long each collective travelled before it was waited for, and how long the wait took.

A profiler shows where a step waits, but it inflates every short range it records and cannot
tell a collective issued early from one issued just before its wait. :class:`WaitTimings`
records, for every zero-comm collective waited through a :class:`~zero_comm.CommWatchdog`
(``watchdog.timings = WaitTimings()``), three ``time.perf_counter`` readings: when it was issued,
when the wait started and when it returned. The *lead* (issue to wait) says how much of the
transfer could overlap other work; the *wait* is what the rank lost. Nothing is recorded while
no recorder is attached; attached, the cost is one dictionary entry per collective.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

__all__ = ["WaitRecord", "WaitTimings"]


@dataclasses.dataclass(frozen=True)
class WaitRecord:
    """One collective waited through the watchdog."""

    op: str
    call: int
    what: str
    issued: float
    waited: float
    done: float

    @property
    def lead_s(self) -> float:
        """Seconds from issue to the start of the wait (the time it had to travel unwaited)."""
        return self.waited - self.issued

    @property
    def wait_s(self) -> float:
        """Seconds the wait took."""
        return self.done - self.waited


class WaitTimings:
    """Issue and wait times of the collectives a watchdog waits for (attach as ``watchdog.timings``)."""

    __slots__ = ("_pending", "records")

    def __init__(self) -> None:
        self.records: list[WaitRecord] = []
        # id(work) -> (work, op, call, what, issued); the work is held so its id is not reused
        self._pending: dict[int, tuple[Any, str, int, str, float]] = {}

    def __repr__(self) -> str:
        return f"WaitTimings(records={len(self.records)}, pending={len(self._pending)})"

    def issued(self, work: Any, op: str, call: int, what: str) -> None:
        """Remember that ``work`` (a collective's work object) was issued now."""
        self._pending[id(work)] = (work, op, call, what, time.perf_counter())

    def waited(self, work: Any, started: float) -> None:
        """Record ``work``'s wait, which started at ``started`` (``perf_counter``) and returned now."""
        done = time.perf_counter()
        entry = self._pending.pop(id(work), None)
        if entry is None or entry[0] is not work:
            return
        _, op, call, what, issued = entry
        self.records.append(WaitRecord(op, call, what, issued, started, done))

    def clear(self) -> None:
        """Forget every record and every collective issued and not yet waited for."""
        self.records.clear()
        self._pending.clear()
