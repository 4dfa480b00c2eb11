"""commit_shards: publish shards an optimizer updated in place (whole parameters, hpZ shards)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.profiler import record_function

from zero_comm import AllGatherStrategy
from zero_params.gather_release import GatherHandle, issue_gather
from zero_params.selection import Item, bucket_key, iter_states
from zero_params.state import ParamStatus, PartitionedParameterError

__all__ = ["commit_shards"]


def commit_shards(params: nn.Parameter | Iterable[nn.Parameter], *, async_op: bool = False) -> GatherHandle:
    """Publish shards that were updated in place (e.g. by an optimizer step)."""
    with record_function("zero.params.commit_shards"):
        buckets: dict[tuple[Any, ...], tuple[AllGatherStrategy, list[Item]]] = {}
        for p, state in iter_states(params):
            state.secondary_valid = False
            if state.status is ParamStatus.INFLIGHT:
                raise PartitionedParameterError(
                    f"commit_shards: parameter {state.display_name!r} is being gathered from its old shard; "
                    "wait() for the gather before updating shards"
                )
            if state.status is ParamStatus.AVAILABLE:
                # a lossy strategy (qwZ) names its exact twin: whole parameters equal their shards
                strategy = getattr(state.gather_strategy, "exact", None) or state.gather_strategy
                key = (bucket_key(strategy), state.dtype, state.device)
                buckets.setdefault(key, (strategy, []))[1].append((p, state))
        ops = [
            issue_gather(strategy, False, items, async_op, refresh=True)
            for strategy, items in buckets.values()
        ]
        handle = GatherHandle(ops)
    if not async_op:
        handle.wait()
    return handle
