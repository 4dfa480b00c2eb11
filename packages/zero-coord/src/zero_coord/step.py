"""The state of the step in progress: its trace, where it stands in it, how far prefetching got."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zero_coord.config import Phase
from zero_coord.trace import Trace, TracePlan

if TYPE_CHECKING:
    from zero_coord.hooks import ModuleHookState

__all__ = ["StepState"]


class StepState:
    """One step, from its root's pre-forward to the end of its backward (or, eval, its forward)."""

    __slots__ = (
        "codes",
        "cursor",
        "forward_done",
        "phase",
        "plan",
        "prefetch_pos",
        "recording",
        "root",
        "trace",
        "valid",
    )

    def __init__(self, phase: Phase, root: ModuleHookState, trace: Trace) -> None:
        self.phase = phase
        self.root = root
        self.trace = trace
        self.valid = trace.begin_step()
        self.plan: TracePlan | None = trace.plan
        self.codes: tuple[int, ...] = self.plan.codes if self.plan is not None else ()
        self.recording = not self.valid
        self.cursor = 0
        self.prefetch_pos = 0
        self.forward_done = False

    def advance(self, code: int) -> bool:
        """Match (or record) the next event; ``False``: the step departs from its valid trace."""
        if self.valid:
            cursor = self.cursor  # plan.matches(), inlined: this runs once per module and pass
            codes = self.codes
            if cursor < len(codes) and codes[cursor] == code:
                self.cursor = cursor + 1
                return True
            return False
        if self.recording:
            self.trace.record(code)
        return True
