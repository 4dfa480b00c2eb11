"""Single-tensor collectives that report to the :class:`~zero_comm.CommLedger`.

Thin wrappers over ``torch.distributed`` for the few plain collectives the upper layers
need (e.g. a ``GatheredParameters`` broadcast, the global gradient norm), so that every
byte zero sends shows up in the ledger. Like ``torch.distributed``, each works in place and
returns its result (the tensor), or with ``async_op=True`` a :class:`TensorHandle` whose
``wait()`` returns it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.checks import check_flat_inputs
from zero_comm.coalesced import result_or_handle
from zero_comm.handles import TensorHandle
from zero_comm.ledger import record, ring_wire_bytes
from zero_comm.profiling import profile_range
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.topology import group_ranks, group_size_and_rank
from zero_comm.watched import watched_call

__all__ = ["all_reduce", "all_to_all_single", "broadcast"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    op: ReduceOpLike = "sum",
    *,
    async_op: bool = False,
) -> torch.Tensor | TensorHandle:
    """Reduce ``tensor`` in place over ``group``."""
    what = "all_reduce"
    with profile_range("zero.all_reduce.issue"):
        world, _ = group_size_and_rank(group, what)
        check_flat_inputs([tensor], what, require_1d=False)
        reduction = Reduction.parse(op, tuple(Reduction), what)
        if reduction is Reduction.AVG and not tensor.is_floating_point():
            raise ValueError(f"{what}: op='avg' needs a floating-point dtype, got {tensor.dtype}")
        nbytes = _nbytes(tensor)
        record(what, group, payload_bytes=nbytes, wire_bytes=ring_wire_bytes(what, nbytes, world))
        work = None
        if world > 1:
            work = watched_call(
                "all_reduce", dist.all_reduce, tensor, op=reduction.torch_op, group=group, async_op=async_op
            )
        return result_or_handle(TensorHandle(what, work, lambda: tensor), async_op)


def broadcast(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, *, async_op: bool = False
) -> torch.Tensor | TensorHandle:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place."""
    what = "broadcast"
    with profile_range("zero.broadcast.issue"):
        world, _ = group_size_and_rank(group, what)
        check_flat_inputs([tensor], what, require_1d=False)
        ranks = group_ranks(group)
        if src not in ranks:
            raise ValueError(f"{what}: src={src} is not a member of the group {list(ranks)}")
        nbytes = _nbytes(tensor)
        payload = nbytes if dist.get_rank() == src else 0
        record(what, group, payload_bytes=payload, wire_bytes=ring_wire_bytes(what, nbytes, world))
        work = None
        if world > 1:
            work = watched_call("broadcast", dist.broadcast, tensor, src=src, group=group, async_op=async_op)
        return result_or_handle(TensorHandle(what, work, lambda: tensor), async_op)


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None = None, *, async_op: bool = False
) -> torch.Tensor | TensorHandle:
    """Equal-split all-to-all: block ``r`` of ``input`` goes to group rank ``r``."""
    what = "all_to_all"
    with profile_range("zero.all_to_all.issue"):
        world, _ = group_size_and_rank(group, what)
        check_flat_inputs([input, output], what, require_1d=False)
        if output.numel() != input.numel() or (input.dim() and input.shape[0] % world):
            raise ValueError(
                f"{what}: input {tuple(input.shape)} and output {tuple(output.shape)} need equal numel "
                f"and a first dimension divisible by the group size {world}"
            )
        nbytes = _nbytes(input)
        record(what, group, payload_bytes=nbytes, wire_bytes=ring_wire_bytes(what, nbytes, world))
        if world == 1:
            output.view(-1).copy_(input.view(-1))
            return result_or_handle(TensorHandle(what, None, lambda: output), async_op)
        work = watched_call(
            "all_to_all", dist.all_to_all_single, output, input, group=group, async_op=async_op
        )
        return result_or_handle(TensorHandle(what, work, lambda: output, keepalive=(input,)), async_op)
