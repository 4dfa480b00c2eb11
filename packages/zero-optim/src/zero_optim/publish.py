"""Stages 1 and 2: the all-gathers after a step, and publishing them while the optimizer steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from zero_comm.profiling import profile_range
from zero_optim.flat import FlatGroup

__all__ = ["GatherBucket", "PipelinedPublish", "StepPublisher", "gather_buckets"]


class _Handle(Protocol):
    def wait(self) -> object: ...


class StepPublisher(Protocol):
    """Publishes a step's updated partitions while the optimizer steps (``Partitioning.step_publisher``).

    :meth:`zero_optim.PartitionedOptimizer.step` passes :attr:`cuts` and :meth:`stepped` to
    :meth:`zero_optim.subgroups.SubGroupStepper.step`, then calls :meth:`finish`: afterwards
    the parameters show the stepped values, exactly as ``Partitioning.after_step`` would
    leave them. :class:`PipelinedPublish` (stages 1 and 2) and
    :class:`zero_optim.stage3.PersistentRefresh` are the two.
    """

    @property
    def cuts(self) -> list[list[int]]:
        """Per group, the flat offsets where a stepped range must end."""
        ...

    def stepped(self, group: int, stop: int) -> None:
        """Flat elements ``[0, stop)`` of ``group`` (and every earlier group) are stepped."""
        ...

    def finish(self) -> None:
        """Publish whatever is left and wait: the parameters show the step (collective)."""
        ...

    def abort(self) -> None:
        """The step raised part way: wait for every collective already issued, publish nothing more.

        Nothing then writes into the parameters after the exception has propagated, and no
        issued collective is left unwaited for the next one to meet.
        """
        ...


@dataclasses.dataclass(frozen=True)
class GatherBucket:
    """Parameters refreshed by one all-gather after a step.

    Attributes:
        items: ``(parameter, its working partition)`` in group then segment order.
        group: Index of the group holding the bucket's last segment.
        end: Flat offset in that group after which every segment of the bucket is stepped.
    """

    items: tuple[tuple[nn.Parameter, torch.Tensor], ...]
    group: int
    end: int


def gather_buckets(groups: Sequence[FlatGroup], world: int, limit: int) -> list[GatherBucket]:
    """Consecutive segments of ``groups``, at most ``limit`` full (padded) elements per bucket.

    A segment larger than ``limit`` is a bucket of its own; buckets may span groups.
    """
    buckets: list[GatherBucket] = []
    items: list[tuple[nn.Parameter, torch.Tensor]] = []
    size, last = 0, (0, 0)
    for gi, group in enumerate(groups):
        for seg in group.segments:
            full = seg.numel * world
            if items and size + full > limit:
                buckets.append(GatherBucket(tuple(items), *last))
                items, size = [], 0
            items.append((seg.param, group.working_view(seg)))
            size += full
            last = (gi, seg.offset + seg.numel)
    if items:
        buckets.append(GatherBucket(tuple(items), *last))
    return buckets


class PipelinedPublish:
    """Publish a step's updated partitions bucket by bucket while the optimizer steps.

    Pass :attr:`cuts` and :meth:`stepped` to :meth:`SubGroupStepper.step`, then call
    :meth:`finish` on every rank. Each stepped range's working copy is refreshed from the
    master (:meth:`FlatGroup.publish_range`), and each bucket's gather is issued as soon as all
    of its segments are stepped — in bucket order, one in flight at a time (each holds its
    gathered buffer until waited for, so the extra memory stays one bucket's).
    """

    __slots__ = ("_groups", "_inflight", "_issue", "_next", "_published", "buckets")

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        buckets: Sequence[GatherBucket],
        issue: Callable[[GatherBucket], _Handle],
    ) -> None:
        self._groups = tuple(groups)
        self.buckets = tuple(buckets)
        self._issue = issue
        self._next = 0
        self._published = [0] * len(self._groups)
        self._inflight: _Handle | None = None

    @property
    def cuts(self) -> list[list[int]]:
        """Per group, the flat offsets where buckets end (where a stepped range must end too)."""
        cuts: list[list[int]] = [[] for _ in self._groups]
        for bucket in self.buckets:
            cuts[bucket.group].append(bucket.end)
        return cuts

    def stepped(self, group: int, stop: int) -> None:
        """Flat elements ``[0, stop)`` of ``group`` (and every earlier group) are stepped."""
        with profile_range("zero.optim.publish"):
            self._groups[group].publish_range(self._published[group], stop)
        self._published[group] = stop
        self._issue_ready((group, stop))

    def _issue_ready(self, done: tuple[int, int]) -> None:
        """Issue, in order, every bucket whose last segment ends at or before ``done``."""
        buckets = self.buckets
        with profile_range("zero.optim.allgather_params"):
            while self._next < len(buckets) and (buckets[self._next].group, buckets[self._next].end) <= done:
                self._wait()
                self._inflight = self._issue(buckets[self._next])
                self._next += 1

    def finish(self) -> None:
        """Issue the buckets left (none after a full step) and wait for every gather."""
        with profile_range("zero.optim.publish"):
            for gi, group in enumerate(self._groups):
                group.publish_range(self._published[gi], group.numel)
                self._published[gi] = group.numel
        self._issue_ready((len(self._groups), 0))
        with profile_range("zero.optim.allgather_params"):
            self._wait()

    def abort(self) -> None:
        """The step raised part way: wait for the gather in flight; issue no other."""
        self._next = len(self.buckets)
        self._wait()

    def _wait(self) -> None:
        """Wait for the gather in flight, if any."""
        if self._inflight is not None:
            handle, self._inflight = self._inflight, None
            handle.wait()
