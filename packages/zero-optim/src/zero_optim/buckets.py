"""Bucketed gradient reduction during backward: the :class:`GradientSink` of the partitioned optimizers.

Buckets are planned once, from the parameter order alone: reverse registration order
(roughly the order backward produces gradients), cut every ``reduce_bucket_size``
elements. A bucket is reduced as soon as all of its parameters reported a gradient and
every earlier bucket was reduced; whatever is left is reduced at the end of the backward,
parameters that got no gradient contributing zeros.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from torch import nn

from zero_comm.profiling import profile_range
from zero_comm.streams import NO_STREAMS, CommStreams, NoStreams
from zero_comm.watched import collective_label, note_collectives

__all__ = ["BucketPlan", "BucketedReducer", "ReduceConfig", "ReduceHandle", "StagedBucket"]


class ReduceHandle(Protocol):
    """What a reduce function returns: ``wait()`` completes the accumulation."""

    def wait(self) -> None: ...


class StagedBucket(Protocol):
    """A bucket whose gradients are copied into one staging buffer as they arrive (contiguous gradients)."""

    def put(self, param: nn.Parameter) -> None:
        """Stage ``param.grad`` and free it."""
        ...

    def issue(self, *, async_op: bool = False) -> ReduceHandle:
        """Reduce the staged bucket (missing gradients as zeros) into the partitions."""
        ...


ReduceFn = Callable[..., ReduceHandle]
"""``reduce_fn(params, async_op=bool)``: reduce the ``.grad`` of ``params`` into their partitions."""


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    """Gradient bucketing policy (DeepSpeed's ``reduce_bucket_size`` and ``overlap_comm``)."""

    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    max_inflight: int = 1

    def __post_init__(self) -> None:
        for name in ("reduce_bucket_size", "max_inflight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ReduceConfig.{name} must be an integer >= 1, got {value!r}")


class BucketPlan:
    """Static buckets over a fixed parameter order."""

    __slots__ = ("buckets", "index", "names", "ordered")

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        numels: Sequence[int],
        bucket_size: int,
        deferred: Collection[nn.Parameter] = (),
    ) -> None:
        late = {id(p) for p in deferred}
        items = list(zip(params, numels, strict=True))
        ordered = _cut([(p, n) for p, n in items if id(p) not in late], bucket_size)
        self.buckets: tuple[tuple[nn.Parameter, ...], ...] = (
            *ordered,
            *_cut([(p, n) for p, n in items if id(p) in late], bucket_size),
        )
        self.ordered = len(ordered)
        self.index: dict[int, int] = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.names: dict[int, str] = {id(p): n for p, n in zip(params, names, strict=True)}

    def __len__(self) -> int:
        return len(self.buckets)


def _cut(items: Sequence[tuple[nn.Parameter, int]], bucket_size: int) -> list[tuple[nn.Parameter, ...]]:
    buckets: list[tuple[nn.Parameter, ...]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param, numel in items:
        if current and size + numel > bucket_size:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(param)
        size += numel
    if current:
        buckets.append(tuple(current))
    return buckets


class BucketedReducer:
    """Reduces gradients bucket by bucket as backward produces them (a ``zero_coord.GradientSink``).

    Gradients accumulate into the partitions across backward passes (micro-steps) until
    the optimizer zeroes its gradient buffer; each backward's gradient is averaged over the
    data-parallel group exactly once (by ``reduce_fn``). With side ``streams`` each bucket is
    reduced on the reduce stream once its gradients are ready, and the end of backward makes
    the compute stream wait on the reductions before the optimizer step.
    """

    __slots__ = ("_config", "_inflight", "_next", "_plan", "_ready", "_reduce", "_staged", "_streams")

    def __init__(
        self,
        plan: BucketPlan,
        reduce_fn: ReduceFn,
        config: ReduceConfig,
        streams: CommStreams | NoStreams = NO_STREAMS,
    ) -> None:
        self._plan = plan
        self._streams = streams
        self._reduce = reduce_fn
        self._config = config
        self._ready = [0] * len(plan)
        self._next = 0
        self._inflight: collections.deque[ReduceHandle] = collections.deque()
        self._staged: dict[int, StagedBucket] = {}

    @property
    def plan(self) -> BucketPlan:
        """The static buckets."""
        return self._plan

    def on_grad_ready(self, param: nn.Parameter) -> None:
        """``param.grad`` holds its full gradient of this backward: count it, reduce complete buckets.

        A parameter this optimizer does not train (left out of every param group) has its
        gradient dropped.

        Raises:
            RuntimeError: the same parameter was reported twice in one backward.
        """
        plan = self._plan
        b = plan.index.get(id(param))
        if b is None:
            param.grad = None
            return
        if b < self._next or self._ready[b] >= len(plan.buckets[b]):
            raise RuntimeError(
                f"the gradient of parameter {plan.names.get(id(param), '?')!r} was reported twice in one "
                "backward; a GradientSink expects one on_grad_ready per parameter per backward"
            )
        self._ready[b] += 1
        stage = self._stage(b)
        if stage is not None:
            stage.put(param)
        while self._next < plan.ordered and self._ready[self._next] >= len(plan.buckets[self._next]):
            self._issue(self._next)
            self._next += 1

    def _stage(self, b: int) -> StagedBucket | None:
        """Bucket ``b``'s staging buffer, opened on its first gradient (``None``: no staging)."""
        stage = self._staged.get(b)
        if stage is None:
            opener = getattr(self._reduce, "open_bucket", None)
            if opener is None:
                return None
            stage = opener(list(self._plan.buckets[b]))
            if stage is None:
                return None
            self._staged[b] = stage
        return stage

    def on_backward_end(self) -> None:
        """Reduce every bucket not reduced yet (missing gradients count as zeros), then wait for all."""
        with profile_range("zero.optim.reduce_flush"):
            for b in range(self._next, len(self._plan)):
                self._issue(b)
            while self._inflight:
                self._inflight.popleft().wait()
            self._streams.wait_reduced()
        self._ready = [0] * len(self._plan)
        self._next = 0

    def _issue(self, b: int) -> None:
        params, names = self._plan.buckets[b], self._plan.names
        note_collectives(
            lambda: collective_label("reduces the gradients of", [names.get(id(p), "?") for p in params])
        )
        with profile_range("zero.optim.reduce_bucket"):
            if self._config.overlap_comm:
                while len(self._inflight) >= self._config.max_inflight:
                    self._inflight.popleft().wait()
            stage = self._staged.pop(b, None)  # None: no gradient of the bucket was staged
            overlap = self._config.overlap_comm
            # on the reduce stream (NoStreams: right here), its inputs kept until compute waited on it
            if stage is not None:
                handle = self._streams.reduce(lambda: stage.issue(async_op=overlap), stage)
            else:
                grads = [p.grad for p in params]
                handle = self._streams.reduce(lambda: self._reduce(list(params), async_op=overlap), grads)
            if overlap:
                self._inflight.append(handle)
