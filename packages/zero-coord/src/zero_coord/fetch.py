"""Fetch and prefetch: gather what a module needs now, and what the trace says comes next.

A fetch waits for the module's parameters that are in flight; with a complete trace it then
prefetches a *window*: the missing parameters of the next trace modules, within
``prefetch_bucket_size`` and ``max_live_parameters``, as one coalesced gather (one collective
per strategy, dtype and device), together with the module's own missing parameters. A new
window starts once at least half the bucket is free again, so steady steps issue one gather
per window, not one per module.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

from torch import nn

from zero_comm.profiling import profile_range
from zero_coord.config import CoordinatorConfig
from zero_coord.hooks import ModuleHookState
from zero_coord.prefetch_source import ShardPrefetcher
from zero_coord.release import Releaser
from zero_coord.slots import GatherBatch, LiveSlots, ParamSlot
from zero_coord.step import StepState

__all__ = ["Fetcher"]

_BY_INDEX = operator.attrgetter("index")


class Fetcher:
    """Gathers a module's parameters when it runs, and prefetches along a complete trace."""

    __slots__ = (
        "bound",
        "bucket",
        "hpz",
        "live",
        "prefetches",
        "refill",
        "releaser",
        "shard_prefetch",
        "windows",
    )

    def __init__(
        self,
        config: CoordinatorConfig,
        live: LiveSlots,
        releaser: Releaser,
        shard_prefetch: ShardPrefetcher | None,
    ) -> None:
        self.bucket = config.prefetch_bucket_size
        self.bound = config.max_live_parameters
        # A new window starts once this many elements of the bucket are free: one gather per
        # half bucket, not one per module, while the next module is always in flight ahead.
        self.refill = max(self.bucket // 2, 1)
        self.live = live
        self.releaser = releaser
        self.shard_prefetch = shard_prefetch
        self.windows = bool(self.bucket)
        self.prefetches = shard_prefetch is not None
        self.hpz = False

    def acquire(self, ms: ModuleHookState, backward: bool = False, step: StepState | None = None) -> None:
        """Hold ``ms``'s parameters: wait for in-flight ones, gather the missing ones (one call).

        ``backward``: gather over the hpZ secondary group where parameters have one.
        ``step``: a valid step with a complete trace: the prefetch window that follows is
        issued before waiting, the missing parameters in the same gather as the window's
        first run (when it is of the same pass).
        """
        live = self.live
        acc = live.acc
        missing: list[ParamSlot] = []
        waits: list[GatherBatch] = []
        for s in ms.slots:
            s.holds += 1
            batch = s.batch
            if batch is None:
                missing.append(s)
                continue
            if (s.retained or s.prefetched) and live.claim(s):
                acc.prefetch_hits += 1
            else:
                acc.reuse_hits += 1
            if batch.handle is not None:
                waits.append(batch)
        ms.active += 1
        if missing:
            acc.prefetch_misses += len(missing)
            need = ms.numel if len(missing) == len(ms.slots) else sum(s.numel for s in missing)
            if live.retained and live.live + need > self.bound:
                self.releaser.evict(need)
            if step is None:
                waits.append(live.gather(missing, secondary=backward, numel=need))
            else:
                with profile_range("zero.coord.prefetch"):
                    waits.append(self._prefetch_gathers(step, missing, need, backward))
        elif step is not None and self.bucket - live.ahead_numel >= self.refill:
            with profile_range("zero.coord.prefetch"):
                self._prefetch_gathers(step, missing, 0, backward)
        for batch in waits:
            batch.wait()

    def prefetch(self, step: StepState) -> None:
        """Offer the upcoming parameters to the shard prefetcher (swap-ins of offloaded shards)."""
        if self.shard_prefetch is not None:
            self.live.acc.shard_prefetches += self.shard_prefetch.prefetch(self._upcoming_params(step))

    def _upcoming_params(self, step: StepState) -> Iterator[tuple[nn.Parameter, bool]]:
        """``(param, swap_in)`` along the trace from the current module (see :class:`ShardPrefetcher`).

        First sight of a parameter that is not gathered: ``True`` (it will be gathered there);
        a later sight of any parameter: ``False`` (needed again, keep its shard if resident).
        """
        event_slots = step.plan.event_slots
        seen: set[ParamSlot] = set()
        for pos in range(max(step.cursor - 1, 0), len(event_slots)):  # the current module first
            for s in event_slots[pos]:
                if s in seen:
                    yield s.param, False
                else:
                    seen.add(s)
                    if s.batch is None:
                        yield s.param, True

    def _prefetch_gathers(
        self, step: StepState, missing: list[ParamSlot], need: int, backward: bool
    ) -> GatherBatch | None:
        """Gather ``missing`` (``need`` elements, held by the current module) and the window after it."""
        live = self.live
        room = self.bucket - live.ahead_numel
        pos = max(step.prefetch_pos, step.cursor)
        plan = step.plan
        event_slots = plan.event_slots
        event_numel = plan.event_numel
        codes = plan.codes
        end = len(event_slots)
        # The run being collected: its pass (``None``: no hpZ parameter in it yet, either),
        # its slots (the first ``held`` are the current module's own), its elements.
        hpz = self.hpz
        run_secondary = backward if hpz and any(s.hpz for s in missing) else None
        run: list[ParamSlot] = missing.copy()
        held = len(missing)
        run_numel = need
        pending = need  # collected, not yet gathered
        mine: GatherBatch | None = None
        window = set(missing)  # collected so far (a slot may recur within the window)
        while pos < end and room > 0:
            slots = event_slots[pos]
            add = [s for s in slots if s.batch is None and s not in window]
            if add:
                numel = event_numel[pos] if len(add) == len(slots) else sum(s.numel for s in add)
                bounded_live = live.live - live.pending_grad_numel  # live.bounded_live, inlined
                if (
                    bounded_live + pending + numel > self.bound
                    and not self.releaser.evict_later_than(step, pos, pending + numel)
                    and not self._over_bound(bounded_live, pending, need, numel)
                ):
                    break
                secondary = bool(codes[pos] & 1)
                if hpz and secondary is not run_secondary and any(s.hpz for s in add):
                    if run_secondary is not None:  # the other pass's hpZ parameters: a new gather
                        batch = self._issue(run, held, need, run_numel - need, run_secondary)
                        mine = mine or (batch if held else None)
                        run, held, run_numel, need = [], 0, 0, 0
                    run_secondary = secondary
                run.extend(add)
                window.update(add)
                run_numel += numel
                pending += numel
                room -= numel
            pos += 1
        step.prefetch_pos = pos
        if run:
            batch = self._issue(run, held, need, run_numel - need, bool(run_secondary))
            mine = mine or (batch if held else None)
        return mine

    def _over_bound(self, bounded_live: int, pending: int, need: int, numel: int) -> bool:
        """Whether a module of ``numel`` elements is prefetched though it crosses ``max_live_parameters``."""
        in_flight = self.live.ahead_numel
        ahead = in_flight + pending - need
        if numel > self.bound:
            return ahead == 0 and bounded_live + pending <= self.bound
        return ahead == 0 or (bounded_live - in_flight + need >= self.bound and ahead < self.refill)

    def _issue(
        self, slots: list[ParamSlot], held: int, held_numel: int, ahead_numel: int, secondary: bool
    ) -> GatherBatch:
        """One gather for ``slots``: the first ``held`` (``held_numel`` elements) for the running
        module, the others (``ahead_numel``) prefetched.

        Gathered in parameter order (the same on every rank): shards bound into one flat buffer
        in that order (an optimizer's) then lie back to back and go to the collective without
        a concatenation, also for a backward window (trace order reversed).
        """
        live = self.live
        ahead = slots[held:] if held else slots
        if len(slots) > 1:
            slots.sort(key=_BY_INDEX)
        batch = live.gather(slots, secondary=secondary, numel=held_numel + ahead_numel)
        if ahead:
            live.mark_prefetched(ahead, ahead_numel)
        return batch
