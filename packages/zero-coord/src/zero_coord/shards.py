"""The interface through which the coordinator asks for offloaded shards ahead of their gather."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["ShardPrefetcher"]


@runtime_checkable
class ShardPrefetcher(Protocol):
    """Starts swap-ins of parameter shards that live off the device (``zero_params.OffloadedShards``).

    ``prefetch(params)`` is called with the parameters of the upcoming modules of the
    recorded trace, in the order they will be gathered, right after the coordinator issued
    (or joined) the gathers it can afford now. It must not block on I/O: it starts reads
    for as many shards as it has room for, consuming ``params`` lazily, and returns the
    number started. The gather of those parameters later waits for the reads
    (``zero_params.gather`` asks the shards' home for their values).
    """

    def prefetch(self, params: Iterable[nn.Parameter]) -> int: ...
