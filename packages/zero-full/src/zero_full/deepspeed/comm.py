"""``deepspeed.comm``: the process-group calls scripts make, forwarded to ``torch.distributed``.

``get_rank``, ``get_world_size``, ``get_local_rank``, ``barrier``, ``all_reduce``,
``broadcast``, ``all_gather``, ``is_initialized`` and ``init_distributed`` (see
:func:`zero_full.deepspeed.init_distributed`). Collectives go to torch directly; zero's
engine counts its own traffic separately.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from zero_full.deepspeed.launch import init_distributed

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
]

ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank (``torch.distributed.get_rank``)."""
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The number of processes (``torch.distributed.get_world_size``)."""
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, set by the launcher; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: Any = None) -> None:
    """``torch.distributed.barrier``."""
    dist.barrier(group)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """``torch.distributed.all_reduce``."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """``torch.distributed.broadcast``."""
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """``torch.distributed.all_gather``."""
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
