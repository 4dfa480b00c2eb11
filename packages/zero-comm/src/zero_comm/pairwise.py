"""The all-gather of a rank-major buffer, and between two gloo ranks one pairwise exchange.

Every gather of zero-comm (coalesced, into destinations, through a communication dtype,
quantized, each hop of the hierarchical one) ends in the same call: fill ``out`` (``world``
rows of ``n`` elements) with every rank's ``send``, row ``r`` from group rank ``r``.
:func:`gather_rows` is that call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.torch_compat import all_gather_single
from zero_comm.watched import watched_call

__all__ = ["exchange_with_peer", "gather_rows", "gathers_pairwise"]


def gathers_pairwise(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether :func:`gather_rows` over ``group`` of tensors on ``device`` is a pairwise exchange.

    True for a group of exactly two ranks whose backend runs CPU tensors on gloo, for CPU
    tensors; the same answer on both ranks (it depends on the group and the device type only).
    """
    if device.type != "cpu" or dist.get_world_size(group) != 2:
        return False
    return "gloo" in str(dist.get_backend(group))


def gather_rows(out: torch.Tensor, send: torch.Tensor, group: ProcessGroup | None, *, async_op: bool) -> Any:
    """``all_gather_single(out, send)``: row ``r`` of ``out`` (``world`` rows) from group rank ``r``."""
    if not gathers_pairwise(group, send.device):
        return watched_call("all_gather", all_gather_single, out, send, group=group, async_op=async_op)
    rank = dist.get_rank(group)
    n = send.numel()
    rows = out.view(2, n)
    own = rows[rank]
    if own.data_ptr() != send.data_ptr():
        own.copy_(send)
    return exchange_with_peer(rows[1 - rank], send, group, async_op=async_op)


def exchange_with_peer(
    peer: torch.Tensor, send: torch.Tensor, group: ProcessGroup | None, *, async_op: bool
) -> Any:
    """The pairwise half of :func:`gather_rows`: ``send`` to the other rank, its ``send`` into ``peer``.

    Only for a group where :func:`gathers_pairwise` holds. A caller that puts this rank's own
    data where it belongs itself (e.g. straight from its shards into the gathered
    parameters) needs no staging row for it.
    """
    n = send.numel()
    if peer.numel() != n:
        raise ValueError(f"exchange_with_peer: peer has {peer.numel()} elements, send {n}; they must match")
    splits = [0, n] if dist.get_rank(group) == 0 else [n, 0]  # nothing to or from this rank itself
    return watched_call(
        "all_gather", dist.all_to_all_single, peer, send, splits, splits, group=group, async_op=async_op
    )
