"""reduce_scatter_grads: average full gradients over the shard group into each rank's gradient partition."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from zero_comm import ReduceScatterHandle, ReduceScatterStrategy
from zero_params.selection import bucket_key
from zero_params.state import ShardedParam, state_of

__all__ = ["GradReduceHandle", "reduce_scatter_grads"]


@dataclasses.dataclass(eq=False)
class _ReduceOp:
    comm: ReduceScatterHandle | None
    states: list[ShardedParam]

    def wait(self) -> None:
        if self.comm is None:
            return
        with record_function("zero.params.reduce_scatter_grads.wait"), torch._C.DisableTorchFunction():
            with torch.no_grad():
                parts = self.comm.wait()
                for state, part in zip(self.states, parts):
                    acc = state.ensure_grad_partition()
                    acc.add_(part.to(acc.device) if part.device != acc.device else part)
        self.comm = None
        self.states = []


class GradReduceHandle:
    """The reduce-scatters of one :func:`reduce_scatter_grads` call.

    ``wait()`` accumulates the averaged partitions into each parameter's gradient partition.
    """

    __slots__ = ("_ops",)

    def __init__(self, ops: list[_ReduceOp]) -> None:
        self._ops = ops

    def __repr__(self) -> str:
        return f"GradReduceHandle(collectives={len(self._ops)})"

    def wait(self) -> None:
        """Block until done; the gradient partitions then hold the accumulated averages."""
        for op in self._ops:
            op.wait()

    def is_completed(self) -> bool:
        """Whether ``wait()`` would not block on communication."""
        return all(op.comm is None or op.comm.is_completed() for op in self._ops)


def reduce_scatter_grads(
    params: nn.Parameter | Iterable[nn.Parameter], *, async_op: bool = False
) -> GradReduceHandle:
    """Average the full ``.grad`` of ``params`` over their shard groups, keep this rank's partition.

    One coalesced reduce-scatter per distinct (reduce strategy, gradient dtype, device).
    The averaged partition is *added* to :attr:`ShardedParam.grad_partition` (allocated
    zero-filled on first use, or the view an optimizer bound with
    :meth:`ShardedParam.bind_grad_partition`), so successive micro-steps accumulate; zero it
    (or the optimizer's flat buffer) after the step. Each ``.grad`` is set to ``None`` when
    the collective is issued, so a following backward starts a fresh gradient. Persistent
    parameters take part like the others. A parameter whose ``.grad`` is ``None`` (unused
    in this micro-step) contributes zeros, so every rank issues the same collective.

    Args:
        params: Partitioned parameters, the same on every rank, in the same order.
        async_op: Return before the communication completes (call ``wait()``).

    Returns:
        A :class:`GradReduceHandle` (already waited for when ``async_op=False``).

    Raises:
        TypeError: a parameter is not partitioned.
        ValueError: a ``.grad`` does not have the parameter's full number of elements.
    """
    with record_function("zero.params.reduce_scatter_grads"), torch._C.DisableTorchFunction():
        buckets: dict[tuple[Any, ...], tuple[ReduceScatterStrategy, list[torch.Tensor], list[ShardedParam]]]
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
            bucket = buckets.setdefault(key, (state.reduce_strategy, [], []))
            bucket[1].append(grad.contiguous())
            bucket[2].append(state)
        ops = [
            _ReduceOp(strategy.reduce_scatter_coalesced(grads, op="avg", async_op=async_op), states)
            for strategy, grads, states in buckets.values()
        ]
        handle = GradReduceHandle(ops)
    if not async_op:
        handle.wait()
    return handle
