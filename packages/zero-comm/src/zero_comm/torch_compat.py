"""``torch.distributed`` calls newer than the oldest torch zero supports, with their older names.

``dist.all_gather_single`` and ``dist.reduce_scatter_single`` exist from torch 2.13; before,
the same collectives are ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (same
arguments, same semantics). zero, its tests included, calls them through this module, which
keeps zero working on torch 2.9 and later (the oldest release the package metadata allows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["all_gather_single", "newest", "reduce_scatter_single"]


def newest(module: Any, name: str, older: str) -> Callable[..., Any]:
    """``module.name`` where this torch has it, else ``module.older``."""
    found = getattr(module, name, None)
    return found if found is not None else getattr(module, older)


all_gather_single: Callable[..., Any] = newest(dist, "all_gather_single", "all_gather_into_tensor")
"""``all_gather_single(output, input, group=None, async_op=False)`` on every supported torch."""

reduce_scatter_single: Callable[..., Any] = newest(dist, "reduce_scatter_single", "reduce_scatter_tensor")
"""``reduce_scatter_single(output, input, op=SUM, group=None, async_op=False)`` on every supported torch."""
