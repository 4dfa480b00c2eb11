"""Release: after a module ran, keep or free its parameters (settle), and make room (evict).

Every decision depends only on the trace and the sizes, never on timing, so all ranks free
the same parameters at the same points.
"""

from __future__ import annotations

import bisect

from zero_coord.config import CoordinatorConfig
from zero_coord.hooks import ModuleHookState
from zero_coord.slots import LiveSlots, ParamSlot
from zero_coord.step import StepState

__all__ = ["Releaser"]


class Releaser:
    """Frees what is not needed soon: settles unheld parameters, evicts kept ones for room.

    Args:
        config: ``max_live_parameters`` and ``max_reuse_distance``.
        live: The live-slot bookkeeping it frees from.
    """

    __slots__ = ("bound", "live", "reuse")

    def __init__(self, config: CoordinatorConfig, live: LiveSlots) -> None:
        self.bound = config.max_live_parameters
        self.reuse = config.max_reuse_distance
        self.live = live

    def release_module(
        self, ms: ModuleHookState, step: StepState | None, backward: bool, recompute: bool = False
    ) -> None:
        """One activation of ``ms`` ended: drop its holds, free or keep what nobody holds."""
        if ms.active == 0:
            return  # already reset (release_all) or never fetched
        ms.active -= 1
        settle: list[ParamSlot] = []
        for s in ms.slots:
            if s.holds > 1:
                s.holds -= 1
                continue
            s.holds = 0
            if s.batch is None:
                continue
            if backward and not s.grad_ready and s.param.requires_grad:
                self.live.set_release_on_grad(s, True)  # its gradient hook releases it
                continue
            if recompute:
                continue  # frozen: live until the final callback releases it
            settle.append(s)
        if settle:
            self.settle(settle, step)

    def settle(self, slots: list[ParamSlot], step: StepState | None) -> None:
        """Decide for unheld gathered slots: keep them or free them."""
        live = self.live
        free = slots
        if step is not None and step.valid:
            free = []
            plan = step.plan
            cum = plan.cum_numel
            uses = plan.uses
            cursor = step.cursor
            here = cum[cursor]
            for s in slots:
                positions = uses.get(s.index, ())  # plan.next_use(), inlined: once per released slot
                i = bisect.bisect_left(positions, cursor)
                nxt = positions[i] if i < len(positions) else None
                if nxt is None:
                    free.append(s)
                elif nxt == cursor:  # the very next module uses it: freeing only re-gathers it
                    live.mark_retained(s)
                elif live.live > self.bound:
                    free.append(s)
                elif nxt < step.prefetch_pos:
                    live.mark_prefetched([s], s.numel)
                elif cum[nxt] - here <= self.reuse:
                    live.mark_retained(s)
                else:
                    free.append(s)
        if free:
            live.free(free)

    def evict(self, need: int) -> None:
        """Free kept-for-reuse parameters, oldest first, until ``need`` more elements fit."""
        live = self.live
        while live.retained and live.live + need > self.bound:
            live.free([next(iter(live.retained))])

    def evict_later_than(self, step: StepState, pos: int, need: int) -> bool:
        """Make room for a prefetch for trace position ``pos``: free kept-for-reuse parameters
        whose next use comes after ``pos`` (they are needed later than what is prefetched),
        until ``need`` more elements fit. Returns whether they fit now."""
        live = self.live
        plan = step.plan
        victims = []
        projected = live.live - live.pending_grad_numel  # live.bounded_live, inlined
        for s in live.retained:
            if projected + need <= self.bound:
                break
            nxt = plan.next_use(s.index, step.cursor)
            if nxt is None or nxt > pos:
                victims.append(s)
                projected -= s.numel
        if victims:
            live.free(victims)
        return live.live - live.pending_grad_numel + need <= self.bound
