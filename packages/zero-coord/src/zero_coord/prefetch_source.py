"""The interface through which the coordinator asks for offloaded shards ahead of their gather."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["ShardPrefetcher"]


@runtime_checkable
class ShardPrefetcher(Protocol):
    """Starts swap-ins of parameter shards that live off the device (``zero_params.OffloadedShards``).

    ``prefetch(upcoming)`` is called after each fetch on a recorded trace, once the
    coordinator issued the gathers it can afford now. ``upcoming`` yields ``(param,
    swap_in)`` in trace order from the current module on: ``swap_in=True`` for a parameter
    that is not gathered and will be gathered there; ``swap_in=False`` for a parameter seen
    earlier in the walk (gathered now, needed again there after a release): keep its shard
    if it is in memory, but do not read it. The prefetcher must not block on I/O: it starts
    reads for as many shards as it has room for, consuming ``upcoming`` lazily, and returns
    the number started. The gather of those parameters later waits for the reads
    (``zero_params.gather`` asks the shards' home for their values).
    """

    def prefetch(self, upcoming: Iterable[tuple[nn.Parameter, bool]]) -> int: ...
