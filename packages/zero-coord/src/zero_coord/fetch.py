"""Fetch and prefetch: gather what a module needs now, and what the trace says comes next.

A fetch waits for the module's parameters that are in flight and gathers the missing ones in
one coalesced call; prefetching then gathers the next trace modules' parameters ahead of use,
one call per module, within ``prefetch_bucket_size`` and ``max_live_parameters``.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from zero_coord.config import CoordinatorConfig
from zero_coord.hooks import ModuleHookState
from zero_coord.prefetch_source import ShardPrefetcher
from zero_coord.release import Releaser
from zero_coord.slots import GatherBatch, LiveSlots, ParamSlot
from zero_coord.step import StepState

__all__ = ["Fetcher"]


class Fetcher:
    """Gathers a module's parameters when it runs, and prefetches along a complete trace.

    Args:
        config: ``prefetch_bucket_size`` and ``max_live_parameters``.
        live: The live-slot bookkeeping it gathers into.
        releaser: Evicts kept parameters to make room.
        shard_prefetch: Offered the upcoming parameters, to swap in offloaded shards.
    """

    __slots__ = ("bound", "bucket", "live", "prefetches", "releaser", "shard_prefetch")

    def __init__(
        self,
        config: CoordinatorConfig,
        live: LiveSlots,
        releaser: Releaser,
        shard_prefetch: ShardPrefetcher | None,
    ) -> None:
        self.bucket = config.prefetch_bucket_size
        self.bound = config.max_live_parameters
        self.live = live
        self.releaser = releaser
        self.shard_prefetch = shard_prefetch
        # Whether prefetch() has anything to do (a bucket or a shard prefetcher): fixed, asked per fetch.
        self.prefetches = bool(self.bucket) or shard_prefetch is not None

    def acquire(self, ms: ModuleHookState, backward: bool = False) -> None:
        """Hold ``ms``'s parameters: wait for in-flight ones, gather the missing ones (one call).

        ``backward``: gather over the hpZ secondary group where parameters have one.
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
            if live.retained:
                need = sum(s.numel for s in missing)
                if live.live + need > self.bound:
                    self.releaser.evict(need)
            waits.append(live.gather(missing, secondary=backward))
        for batch in waits:
            batch.wait()

    def prefetch(self, step: StepState) -> None:
        """Prefetch along the trace: gathers within the bucket, then swap-ins of offloaded shards beyond."""
        if self.bucket:
            self._prefetch_gathers(step)
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

    def _prefetch_gathers(self, step: StepState) -> None:
        """Issue async gathers (one per module) for the next trace modules within the bucket and bound."""
        live = self.live
        room = self.bucket - live.ahead_numel
        pos = max(step.prefetch_pos, step.cursor)
        plan = step.plan
        event_slots = plan.event_slots
        event_numel = plan.event_numel
        codes = plan.codes
        end = len(event_slots)
        while pos < end and room > 0:
            slots = event_slots[pos]
            add = [s for s in slots if s.batch is None]
            if add:
                numel = event_numel[pos] if len(add) == len(slots) else sum(s.numel for s in add)
                if live.bounded_live + numel > self.bound and not self.releaser.evict_later_than(
                    step, pos, numel
                ):
                    break
                live.gather(add, secondary=bool(codes[pos] & 1), numel=numel)
                live.mark_prefetched(add, numel)
                room -= numel
            pos += 1
        step.prefetch_pos = pos
