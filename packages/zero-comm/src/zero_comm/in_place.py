"""The reduce-scatter whose result lands in the inputs themselves: each rank's own row of each region.

Stage 1 keeps whole gradients in one flat buffer, each parameter in a region padded to
``world * P`` elements, and trains row ``rank`` of every region. :func:`reduce_scatter_in_place`
reduces those regions over the group and writes the reduced row back where this rank's row
lies: only the other ranks' rows are staged and sent, and the received rows are added
straight into the own rows (one ``_foreach_add_`` per received row). The padded reduce-scatter
(:func:`~zero_comm.reduce_scatter_coalesced_padded`) would stage this rank's row too, sum into
that copy and leave the caller a copy back: two copies of ``P`` per region that this saves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.coalesced import (
    adjacent_flat_view,
    issue_reduce_scatter,
    reduce_scatter_inputs,
    result_or_handle,
)
from zero_comm.handles import ReduceScatterHandle
from zero_comm.profiling import profile_range
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.row_exchange import ADD_CHAIN_MAX_ROWS, record_padded_reduce_scatter
from zero_comm.watched import watched_call

__all__ = ["reduce_scatter_in_place"]


def reduce_scatter_in_place(
    regions: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    op: ReduceOpLike = "avg",
    async_op: bool = False,
) -> list[torch.Tensor] | ReduceScatterHandle:
    """Reduce padded regions over ``group``; this rank's row of each region receives the result."""
    what = "reduce_scatter_in_place"
    with profile_range("zero.reduce_scatter.issue"):
        world, rank, reduction = reduce_scatter_inputs(regions, group, op, what, require_1d=True)
        first = regions[0]
        if not first.is_floating_point():
            raise ValueError(f"{what}: needs a floating-point dtype, got {first.dtype}")
        for i, region in enumerate(regions):
            if region.numel() % world:
                raise ValueError(
                    f"{what}: region {i} has {region.numel()} elements, not a multiple of the "
                    f"group size {world}; pad each region to world * partition_numel(numel, world)"
                )
        parts = [r.numel() // world for r in regions]
        own = [r.narrow(0, rank * p, p) for r, p in zip(regions, parts, strict=True)]
        if world > ADD_CHAIN_MAX_ROWS or first.dtype in (torch.float16, torch.bfloat16):
            reduced = issue_reduce_scatter(regions, group, op=reduction, async_op=async_op)
            return result_or_handle(reduced.then(lambda sums: _copy_into(own, sums)), async_op)
        record_padded_reduce_scatter(group, sum(r.numel() for r in regions), parts, world, first)
        if world == 1:  # the sum over one rank is the row itself, and so is its mean
            return result_or_handle(ReduceScatterHandle("reduce_scatter", None, lambda: own), async_op)
        average = reduction is Reduction.AVG
        return result_or_handle(
            _exchange(regions, parts, own, rank, world, average, group, async_op), async_op
        )


def _exchange(
    regions: Sequence[torch.Tensor],
    parts: list[int],
    own: list[torch.Tensor],
    rank: int,
    world: int,
    average: bool,
    group: ProcessGroup | None,
    async_op: bool,
) -> ReduceScatterHandle:
    """Send the other ranks' rows (one ``all_to_all_single``); ``wait()`` sums into the own rows."""
    total = sum(parts)
    peers = [r for r in range(world) if r != rank]
    pieces = [region.narrow(0, r * p, p) for r in peers for region, p in zip(regions, parts, strict=True)]
    send = adjacent_flat_view(pieces)  # other ranks' rows back to back (one region): sent as they lie
    if send is None:
        send = torch.cat(pieces)
    recv = torch.empty_like(send)
    splits = [0 if r == rank else total for r in range(world)]
    work = watched_call(
        "reduce_scatter", dist.all_to_all_single, recv, send, splits, splits, group=group, async_op=async_op
    )

    def finish() -> list[torch.Tensor]:
        received = [list(row.split(parts)) for row in recv.view(world - 1, total)]
        _sum_rows_into(own, received, rank, world, average)
        return own

    return ReduceScatterHandle("reduce_scatter", work, finish, keepalive=(send,))


def _sum_rows_into(
    own: list[torch.Tensor], received: list[list[torch.Tensor]], rank: int, world: int, average: bool
) -> None:
    """``own = sum of the rows in rank order`` (``/ world`` if ``average``), own row included in place."""
    with profile_range("zero.reduce_scatter.local_sum"):
        others = iter(received)
        rows = [own if r == rank else next(others) for r in range(world)]
        # rows[0] + rows[1] == rows[1] + rows[0] exactly: ranks 0 and 1 start from their own row
        acc = own if rank < 2 else rows[0]
        torch._foreach_add_(acc, rows[0] if rank == 1 else rows[1])
        for r in range(2, world):
            torch._foreach_add_(acc, rows[r])
        if average:
            torch._foreach_div_(acc, float(world))
        if acc is not own:
            torch._foreach_copy_(own, acc)


def _copy_into(own: list[torch.Tensor], sums: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy reduced partitions into the own rows (the padded reduce-scatter's fallback)."""
    torch._foreach_copy_(own, sums)
    return own
