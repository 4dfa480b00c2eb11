"""The interface through which the coordinator asks for offloaded shards ahead of their gather."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["ShardPrefetcher"]


@runtime_checkable
class ShardPrefetcher(Protocol):
    """Starts swap-ins of parameter shards that live off the device (``zero_params.OffloadedShards``)."""

    def prefetch(self, upcoming: Iterable[tuple[nn.Parameter, bool]]) -> int: ...
