"""hpZ (ZeRO++ hierarchical partitioning): the secondary shard over a smaller (node-local) group.

A primary gather builds each parameter's secondary shard (:func:`build_secondary`); a backward
gather with ``secondary=True`` then stays inside the secondary group. Updating the primary shards
makes the secondary ones stale (:func:`invalidate_secondary`; ``commit_shards`` calls it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zero_comm import partition_numel, shard_range
from zero_params.selection import iter_states
from zero_params.state import ShardedParam

__all__ = ["build_secondary", "invalidate_secondary"]


def build_secondary(state: ShardedParam, full_flat: torch.Tensor) -> None:
    """Keep this rank's partition over the secondary (hpZ) group of a freshly gathered parameter."""
    strategy = state.secondary_strategy
    if strategy is None:
        return
    part = partition_numel(state.numel, strategy.group_size)
    start, stop = shard_range(state.numel, strategy.group_size, strategy.group_rank)
    sec = state.secondary_shard
    if sec is None or sec.numel() != part or sec.dtype != state.dtype:
        sec = torch.empty(part, dtype=state.dtype, device=state.shard.device)
        state.secondary_shard = sec
    sec[: stop - start].copy_(full_flat[start:stop])
    sec[stop - start :].zero_()
    state.secondary_valid = True


def invalidate_secondary(params: nn.Parameter | Iterable[nn.Parameter]) -> None:
    """Mark the hpZ secondary shards of ``params`` stale (their primary shards changed).

    The next primary gather rebuilds them; until then ``gather(..., secondary=True)`` falls
    back to the primary group. :func:`commit_shards` calls this for you.
    """
    for _, state in iter_states(params):
        state.secondary_valid = False
