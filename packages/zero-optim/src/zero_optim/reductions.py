"""How whole gradients reach the fp32 gradient partitions of stages 0, 1 and 2 (a :class:`GradientReduction`).

* :class:`BoundaryReduction` (stage 0, and stage 1 when asked for): autograd accumulates the
  whole gradients over the micro-steps; one bucketed reduction after the boundary backward.
* :class:`BackwardReduction` (stage 1): the same buckets and collectives, issued during the
  boundary micro-step's backward, each bucket as soon as all of its gradients are accumulated
  (as DDP overlaps its all-reduce with backward).
* :class:`HookedReduction` (stage 2): every boundary backward feeds a
  :class:`~zero_optim.buckets.BucketedReducer`.

With side ``streams`` (``zero_comm.CommStreams``) every bucket is reduced on the reduce stream
after its gradients are ready, and the compute stream waits on the reductions before anything
reads the partitions; without (``NO_STREAMS``, CPU) everything runs where it is called.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from zero_comm.profiling import profile_range
from zero_comm.streams import NO_STREAMS, CommStreams, NoStreams
from zero_comm.watched import collective_label, note_collectives
from zero_optim.buckets import BucketedReducer, BucketPlan, ReduceHandle

__all__ = ["BackwardReduction", "BoundaryReduction", "GradientReduction", "HookedReduction"]

ReduceFn = Callable[..., ReduceHandle]


def _issue_on(
    streams: CommStreams | NoStreams, reduce_fn: ReduceFn, params: list[nn.Parameter]
) -> ReduceHandle:
    """``reduce_fn(params, async_op=True)`` through ``streams.reduce``: on the reduce stream, the
    gradients it reads referenced until compute waited on it (``NO_STREAMS``: where called)."""
    return streams.reduce(lambda: reduce_fn(params, async_op=True), [p.grad for p in params])


class GradientReduction(Protocol):
    """How full gradients reach the fp32 gradient partitions, for the engine to drive."""

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Called before each backward: whether this micro-step ends the accumulation window."""
        ...

    def at_boundary(self) -> None:
        """Reduce whatever is still pending before the optimizer step (every rank calls it)."""
        ...

    def remove(self) -> None:
        """Remove any hooks installed on the model."""
        ...


@dataclasses.dataclass(eq=False, slots=True)
class BoundaryReduction:
    """Stages 0 and 1: autograd accumulates whole gradients; one bucketed reduction at the boundary.

    Args:
        plan: The static buckets (``reduce_bucket_size``), the same order on every rank.
        reduce_fn: :class:`AllReduceInto` (stage 0) or :class:`ReduceScatterInto` (stage 1).
        max_inflight: Buckets in flight at once (bounds the staging memory).
        streams: The reduce side stream (``NO_STREAMS``: the current stream).
    """

    plan: BucketPlan
    reduce_fn: ReduceFn
    max_inflight: int = 1
    streams: CommStreams | NoStreams = NO_STREAMS

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Nothing to do: autograd accumulates whole gradients until :meth:`at_boundary`."""

    def at_boundary(self) -> None:
        """Reduce every bucket, at most ``max_inflight`` in flight at once."""
        with profile_range("zero.optim.reduce_at_boundary"):
            inflight: collections.deque[ReduceHandle] = collections.deque()
            for bucket in self.plan.buckets:
                if len(inflight) >= self.max_inflight:
                    inflight.popleft().wait()
                inflight.append(_issue_on(self.streams, self.reduce_fn, list(bucket)))
            while inflight:
                inflight.popleft().wait()
            self.streams.wait_reduced()

    def remove(self) -> None:
        """Nothing installed."""


class _BackwardHooked(abc.ABC):
    """Shared by the reductions driven by post-accumulate-grad hooks: deferral, end of backward, removal.

    ``begin_micro_step(False)`` defers (autograd keeps accumulating ``.grad``); otherwise the
    first gradient of a backward queues one autograd final callback, which ends the deferral
    and calls :meth:`_end_backward`. Every hook handle lives in ``_handles``.
    """

    __slots__ = ("_defer", "_handles", "_queued")

    def __init__(self) -> None:
        self._defer = False
        self._queued = False
        self._handles: list[RemovableHandle] = []

    def _reducing(self) -> bool:
        """Whether this backward reduces; queues the end-of-backward callback on its first gradient."""
        if self._defer:
            return False
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._on_backward_end)
        return True

    def _on_backward_end(self) -> None:
        self._queued = False
        self._defer = False
        self._end_backward()

    @abc.abstractmethod
    def _end_backward(self) -> None:
        """Reduce what this backward left (called once, when it ends)."""

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


class BackwardReduction(_BackwardHooked):
    """Stage 1: the boundary reduction of :class:`BoundaryReduction`, issued during the boundary backward."""

    __slots__ = (
        "_accumulated",
        "_before_accumulate",
        "_carry",
        "_inflight",
        "_next",
        "_ready",
        "_reduced",
        "_scaled",
        "_unreduced",
        "max_inflight",
        "plan",
        "reduce_fn",
        "streams",
    )

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        plan: BucketPlan,
        reduce_fn: ReduceFn,
        max_inflight: int = 1,
        streams: CommStreams | NoStreams = NO_STREAMS,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.reduce_fn = reduce_fn
        self.max_inflight = max_inflight
        self.streams = streams
        self._next = 0
        self._ready = [0] * len(plan)
        self._inflight: collections.deque[ReduceHandle] = collections.deque()
        self._reduced = False  # a backward reduced this window
        self._unreduced = False  # gradients accumulated since the last reduction
        self._carry: Callable[[nn.Parameter], None] | None = getattr(reduce_fn, "carry", None)
        self._accumulated: Callable[[nn.Parameter], None] | None = getattr(reduce_fn, "accumulated", None)
        self._before_accumulate: Callable[[nn.Parameter], None] | None = getattr(
            reduce_fn, "before_accumulate", None
        )
        self._scaled: set[int] | None = None  # carrying: parameters whose partition was scaled
        for p in params:
            self._handles.append(p.register_hook(self._before_grad_hook(p)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Reduce during this backward only if it ends the accumulation window."""
        self._defer = not is_boundary

    def _before_grad_hook(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            self._unreduced = True
            if self._before_accumulate is not None:
                with torch.no_grad():
                    self._before_accumulate(param)
            if self._scaled is not None and id(param) not in self._scaled:
                self._carry_over(param)

        return hook

    def _carry_over(self, param: nn.Parameter) -> None:
        """Scale ``param``'s reduced partition for the next reduction (once per window reduction)."""
        self._drain()  # the partition must hold its reduced values first
        if self._carry is not None and self._scaled is not None:
            self._scaled.add(id(param))
            with torch.no_grad():
                self._carry(param)

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._accumulated is not None:
            with profile_range("zero.optim.accumulate_grad"), torch.no_grad():
                self._accumulated(param)
        if not self._reducing():
            return
        plan = self.plan
        b = plan.index[id(param)]
        self._ready[b] += 1
        while self._next < len(plan) and self._ready[self._next] >= len(plan.buckets[self._next]):
            self._issue(self._next)
            self._next += 1

    def _issue(self, b: int) -> None:
        params, names = list(self.plan.buckets[b]), self.plan.names
        note_collectives(
            lambda: collective_label("reduces the gradients of", [names.get(id(p), "?") for p in params])
        )
        if self._scaled is not None:  # parameters without a gradient since the last reduction
            for p in params:
                if id(p) not in self._scaled:
                    self._carry_over(p)
        with profile_range("zero.optim.reduce_bucket"):
            while len(self._inflight) >= self.max_inflight:
                self._inflight.popleft().wait()
            self._inflight.append(_issue_on(self.streams, self.reduce_fn, params))

    def _end_backward(self) -> None:
        with profile_range("zero.optim.reduce_flush"):
            self._reduce_rest()

    def _reduce_rest(self) -> None:
        for b in range(self._next, len(self.plan)):
            self._issue(b)
        self._next = 0
        self._ready = [0] * len(self.plan)
        self._reduced = True
        self._unreduced = False
        self._scaled = set() if self._carry is not None else None

    def _drain(self) -> None:
        """Finish every reduction in flight; compute waits on them before reading the partitions."""
        while self._inflight:
            self._inflight.popleft().wait()
        self.streams.wait_reduced()

    def at_boundary(self) -> None:
        """Wait for the reductions in flight; reduce every bucket if no backward did since."""
        with profile_range("zero.optim.reduce_at_boundary"):
            if not self._reduced or self._unreduced:
                self._reduce_rest()
            self._drain()
        self._reduced = False
        self._unreduced = False
        self._scaled = None


class HookedReduction(_BackwardHooked):
    """Stage 2: a post-accumulate-grad hook per parameter feeds a :class:`BucketedReducer`.

    The hooks are installed here, in one place, with removable handles; the end of each
    backward (an autograd final callback queued by the first hook) flushes the reducer, so
    plain ``loss.backward()`` works too.
    """

    __slots__ = ("reducer",)

    def __init__(self, params: Sequence[nn.Parameter], reducer: BucketedReducer) -> None:
        super().__init__()
        self.reducer = reducer
        self._handles.extend(p.register_post_accumulate_grad_hook(self._on_grad) for p in params)

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Defer reduction (keep accumulating ``.grad``) unless this micro-step is the boundary."""
        self._defer = not is_boundary

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._reducing():
            self.reducer.on_grad_ready(param)  # type: ignore[arg-type]

    def _end_backward(self) -> None:
        self.reducer.on_backward_end()

    def at_boundary(self) -> None:
        """Nothing pending: every backward was reduced when it ended."""
