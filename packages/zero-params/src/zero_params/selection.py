"""Which partitioned parameters an operation acts on, and how they are bucketed into collectives."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from zero_params.state import STATE_ATTR, ShardedParam

__all__ = ["Item", "bucket_key", "iter_states"]

Item = tuple[nn.Parameter, ShardedParam]
"""A partitioned parameter with its state."""


def bucket_key(strategy: Any) -> Any:
    """Bucket key of a strategy: the object itself, so strategies that define value equality
    (``__eq__`` / ``__hash__``) coalesce across objects; identity otherwise."""
    try:
        hash(strategy)
    except TypeError:
        return id(strategy)
    return strategy


def iter_states(params: Iterable[Any]) -> Iterator[tuple[nn.Parameter, ShardedParam]]:
    """Partitioned parameters with their states, each once; others are skipped."""
    if isinstance(params, torch.Tensor):
        params = [params]
    seen: set[int] = set()
    for p in params:
        state = getattr(p, STATE_ATTR, None)
        if not isinstance(state, ShardedParam) or id(p) in seen:
            continue
        seen.add(id(p))
        yield p, state
