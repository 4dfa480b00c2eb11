"""reduce_scatter_grads: average full gradients over the shard group into each rank's gradient partition."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zero_comm import (
    AllToAllReduceScatter,
    CastReduceScatter,
    GradientBound,
    NativeReduceScatter,
    ReduceScatterHandle,
    ReduceScatterStrategy,
)
from zero_comm.adjacent_runs import add_in_runs, adjacent_runs, in_fewer_runs
from zero_comm.profiling import profile_range
from zero_params.ops_handle import OpsHandle
from zero_params.selection import bucket_key
from zero_params.state import ShardedParam, state_of

__all__ = ["GradReduceHandle", "reduce_scatter_grads"]

_ORDER_FREE = (AllToAllReduceScatter, CastReduceScatter, NativeReduceScatter)
"""Strategies whose every element's result is independent of the tensors' order in the call
(quantized ones group elements across tensors, so their order is kept as given)."""


@dataclasses.dataclass(eq=False)
class _ReduceOp:
    """One coalesced reduce-scatter in flight and where its partitions go (``runs`` of ``targets``)."""

    comm: ReduceScatterHandle | None
    targets: list[torch.Tensor]
    runs: list[tuple[int, int]]
    before_add: Callable[[], None] | None = None

    def wait(self) -> None:
        if self.comm is None:
            return
        with profile_range("zero.params.reduce_scatter_grads.wait"), torch._C.DisableTorchFunction():
            with torch.no_grad():
                reduced = self.comm.wait()
                self.comm = None  # the gradients it sent are freed before the partitions are touched
                if self.before_add is not None:
                    self.before_add()
                add_in_runs(self.targets, reduced, self.runs)
        self.targets, self.runs = [], []

    def is_completed(self) -> bool:
        return self.comm is None or self.comm.is_completed()


class _PairPartitions:
    """:class:`zero_comm.adjacent_runs.GradPartitions` of ``(state, grad)`` pairs: the (ensured) partition."""

    __slots__ = ()

    def grad_partition(self, item: tuple[ShardedParam, torch.Tensor], /) -> torch.Tensor:
        return item[0].ensure_grad_partition()


class GradReduceHandle(OpsHandle):
    """The reduce-scatters of one :func:`reduce_scatter_grads` call.

    ``wait()`` accumulates the averaged partitions into each parameter's gradient partition.
    """

    __slots__ = ()


def reduce_scatter_grads(
    params: nn.Parameter | Iterable[nn.Parameter],
    *,
    async_op: bool = False,
    bound: GradientBound | None = None,
    before_add: Callable[[], None] | None = None,
) -> GradReduceHandle:
    """Average the full ``.grad`` of ``params`` over their shard groups, keep this rank's partition.

    ``before_add`` (if given) is called once the reduced partitions have arrived and before
    they are added into the gradient partitions (once per collective of the call): an owner
    that reserved the partitions without filling them fills them there.
    """
    with profile_range("zero.params.reduce_scatter_grads"), torch._C.DisableTorchFunction():
        buckets: dict[tuple[Any, ...], tuple[ReduceScatterStrategy, list[tuple[ShardedParam, torch.Tensor]]]]
        buckets = {}
        if isinstance(params, torch.Tensor):
            params = [params]
        seen: set[int] = set()
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            state = state_of(p)
            grad = p.grad
            if grad is None:
                grad = torch.zeros(state.shape, dtype=state.dtype, device=state.device)
            elif grad.numel() != state.numel:
                raise ValueError(
                    f"reduce_scatter_grads: .grad of {state.display_name!r} has {grad.numel()} elements, "
                    f"expected the full {state.numel} (shape {tuple(state.shape)}); gradients are "
                    "reduce-scattered once per micro-step, before the parameter is re-partitioned"
                )
            p.grad = None
            key = (bucket_key(state.reduce_strategy), grad.dtype, grad.device)
            buckets.setdefault(key, (state.reduce_strategy, []))[1].append((state, grad.contiguous()))
        ops = [_issue(strategy, pairs, async_op, bound, before_add) for strategy, pairs in buckets.values()]
        handle = GradReduceHandle(ops)
    if not async_op:
        handle.wait()
    return handle


def _issue(
    strategy: ReduceScatterStrategy,
    pairs: list[tuple[ShardedParam, torch.Tensor]],
    async_op: bool,
    bound: GradientBound | None = None,
    before_add: Callable[[], None] | None = None,
) -> _ReduceOp:
    """One collective over ``pairs``, so that ``wait()`` adds each adjacent run of gradient
    partitions with one ``add_``.
    """
    if isinstance(strategy, _ORDER_FREE):
        pairs, targets, runs = in_fewer_runs(pairs, _PairPartitions())
    else:
        targets = [state.ensure_grad_partition() for state, _ in pairs]
        runs = adjacent_runs(targets)
    if bound is not None:
        strategy = bound.riding(strategy, f"reduce_scatter_grads: {pairs[0][0].display_name!r}")
    comm = strategy.reduce_scatter_coalesced([g for _, g in pairs], op="avg", async_op=async_op)
    return _ReduceOp(comm, targets, runs, before_add)
