"""Collectives that communicate in a narrower dtype: DeepSpeed's ``communication_data_type``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.checks import check_flat_inputs
from zero_comm.coalesced import check_gather_outputs, copy_columns_strided
from zero_comm.handles import AllGatherHandle, ReduceScatterHandle, TensorHandle
from zero_comm.ledger import record, ring_wire_bytes
from zero_comm.pairwise import gather_rows, gathers_pairwise
from zero_comm.partition import partition_numel
from zero_comm.profiling import profile_range
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.row_exchange import interleave
from zero_comm.strategies import OnGroup
from zero_comm.watched import watched_call

__all__ = ["COMM_DTYPES", "CastAllGather", "CastAllReduce", "CastReduceScatter"]

COMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The communication dtypes accepted (DeepSpeed's ``"fp32"``, ``"bf16"``, ``"fp16"``)."""

_RS_OPS = (Reduction.SUM, Reduction.AVG)


def _check_dtype(dtype: torch.dtype, what: str) -> torch.dtype:
    if dtype not in COMM_DTYPES:
        raise ValueError(
            f"{what}: communication dtype must be torch.float32, torch.bfloat16 or torch.float16, "
            f"got {dtype!r}"
        )
    return dtype


def _check_float(tensors: Sequence[torch.Tensor], what: str) -> None:
    if not tensors[0].is_floating_point():
        raise ValueError(f"{what}: casting collectives move floating-point tensors, got {tensors[0].dtype}")


class _OnGroupThroughDtype(OnGroup):
    """A strategy over one group that moves its values as ``dtype`` (checked first)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype, group: ProcessGroup | None = None) -> None:
        self.dtype = _check_dtype(dtype, type(self).__name__)
        super().__init__(group)

    def _repr_fields(self) -> str:
        return f"dtype={self.dtype}, {super()._repr_fields()}"


class CastAllGather(_OnGroupThroughDtype):
    """All-gather that sends the shards as ``dtype`` and writes the result back in the shards' dtype.

    Args:
        dtype: The communication dtype (``torch.bfloat16`` or ``torch.float16``; fp32 works too).
        group: Process group (``None``: the world).
    """

    __slots__ = ()

    def all_gather_coalesced(
        self, shards: Sequence[torch.Tensor], *, async_op: bool = False, out: torch.Tensor | None = None
    ) -> AllGatherHandle:
        """Like :func:`zero_comm.all_gather_coalesced`: full tensors as views of one flat buffer.

        The buffer (``out`` if given, else new) has the shards' dtype; the values went
        through ``dtype``.
        """
        check_flat_inputs(shards, "CastAllGather.all_gather_coalesced", require_1d=True)
        sizes = [s.numel() for s in shards]
        need = self.group_size * sum(sizes)
        first = shards[0]
        if out is None:
            out = torch.empty(need, dtype=first.dtype, device=first.device)
        elif out.numel() != need or out.dtype != first.dtype or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(
                f"CastAllGather.all_gather_coalesced: out must be a contiguous 1-D {first.dtype} tensor of "
                f"{need} elements (group size x sum of shard numels), got {out.dtype} {tuple(out.shape)}"
            )
        outputs = list(torch.split(out, [self.group_size * n for n in sizes]))
        return self.all_gather_coalesced_into(shards, outputs, async_op=async_op)

    def all_gather_coalesced_into(
        self, shards: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *, async_op: bool = False
    ) -> AllGatherHandle:
        """Like :func:`zero_comm.all_gather_coalesced_into`, casting on the way in and out.

        ``outputs[i]`` receives the first ``outputs[i].numel()`` elements of gathered tensor
        ``i`` in its own dtype (one casting copy per element; the collective moves ``dtype``).

        Raises:
            ValueError: empty, mixed or non-floating shards, or a wrong number / size of outputs.
        """
        what = "CastAllGather.all_gather_coalesced_into"
        with profile_range("zero.all_gather.issue"):
            check_flat_inputs(shards, what, require_1d=True)
            _check_float(shards, what)
            check_gather_outputs(shards, outputs, self.group_size, what, same_dtype=False)
            world = self.group_size
            sizes = [s.numel() for s in shards]
            total = sum(sizes)
            device = shards[0].device
            staging = torch.empty(world, total, dtype=self.dtype, device=device)
            # alone, or between two gloo ranks, the cast lands in this rank's own row: nothing to copy
            in_row = world == 1 or gathers_pairwise(self.group, device)
            send = staging[self.group_rank] if in_row else torch.empty(total, dtype=self.dtype, device=device)
            if total:
                torch.cat(list(shards), out=send)
            shard_bytes = total * send.element_size()
            record(
                "all_gather",
                self.group,
                payload_bytes=shard_bytes,
                wire_bytes=ring_wire_bytes("all_gather", shard_bytes, world),
            )
            outs = list(outputs)
            work = None
            if world > 1 and total:
                work = gather_rows(staging.view(-1), send, self.group, async_op=async_op)

            def finish() -> list[torch.Tensor]:
                copy_columns_strided(staging, sizes, outs)
                return outs

            handle = AllGatherHandle("all_gather", work, finish, keepalive=(send,))
            if not async_op:
                handle.wait()
            return handle


class CastReduceScatter(_OnGroupThroughDtype):
    """Reduce-scatter that sends ``dtype`` and sums / averages the received rows in the input dtype.

    Same result layout as :func:`zero_comm.reduce_scatter_coalesced` (this rank's padded
    partition of each tensor, views of one flat buffer of the input dtype).

    Args:
        dtype: The communication dtype.
        group: Process group (``None``: the world).
    """

    __slots__ = ()

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], *, op: ReduceOpLike = "avg", async_op: bool = False
    ) -> ReduceScatterHandle:
        """Reduce ``tensors`` over the group through ``dtype``; keep this rank's partition of each.

        Raises:
            ValueError: empty, mixed, non-contiguous or non-floating tensors, or an ``op``
                other than ``"sum"`` / ``"avg"``.
        """
        what = "CastReduceScatter.reduce_scatter_coalesced"
        with profile_range("zero.reduce_scatter.issue"):
            check_flat_inputs(tensors, what, require_1d=False)
            _check_float(tensors, what)
            reduction = Reduction.parse(op, _RS_OPS, what)
            world = self.group_size
            parts = [partition_numel(t.numel(), world) for t in tensors]
            first = tensors[0]
            send, _ = interleave(tensors, parts, world, None, dtype=self.dtype)
            es = send.element_size()
            record(
                "reduce_scatter",
                self.group,
                payload_bytes=sum(t.numel() for t in tensors) * es,
                wire_bytes=ring_wire_bytes("reduce_scatter", send.numel() * es, world),
            )
            recv = send
            work = None
            if world > 1 and send.numel():
                recv = torch.empty_like(send)
                work = watched_call(
                    "reduce_scatter",
                    dist.all_to_all_single,
                    recv,
                    send,
                    group=self.group,
                    async_op=async_op,
                )
            out = torch.empty(sum(parts), dtype=first.dtype, device=first.device)

            def finish() -> list[torch.Tensor]:
                with profile_range("zero.reduce_scatter.local_sum"):
                    rows = recv.view(world, -1)
                    acc = out if out.dtype == torch.float32 else torch.empty_like(out, dtype=torch.float32)
                    acc.copy_(rows[0])
                    for r in range(1, world):
                        acc.add_(rows[r])
                    if reduction is Reduction.AVG:
                        acc.div_(world)
                    if acc is not out:
                        out.copy_(acc)
                return list(torch.split(out, parts))

            handle = ReduceScatterHandle("reduce_scatter", work, finish, keepalive=(send,))
            if not async_op:
                handle.wait()
            return handle


class CastAllReduce:
    """All-reduce through ``dtype``: a :class:`CastReduceScatter`, then a :class:`CastAllGather`.

    Moves the ring all-reduce's bytes in ``dtype``; sums in the input dtype (never in half
    precision on the wire); the result lands in the input tensor.

    Args:
        dtype: The communication dtype.
        group: Process group (``None``: the world).
    """

    __slots__ = ("gather", "reduce")

    def __init__(self, dtype: torch.dtype, group: ProcessGroup | None = None) -> None:
        self.reduce = CastReduceScatter(dtype, group)
        self.gather = CastAllGather(dtype, group)

    def __repr__(self) -> str:
        return f"CastAllReduce(dtype={self.reduce.dtype}, group_size={self.reduce.group_size})"

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpLike = "avg") -> TensorHandle:
        """Reduce the contiguous floating-point ``tensor`` in place (``"sum"`` or ``"avg"``), synchronously.

        Returns:
            A finished handle whose ``wait()`` returns ``tensor``.
        """
        with profile_range("zero.all_reduce.cast"):
            flat = tensor.view(-1)
            (part,) = self.reduce.reduce_scatter_coalesced([flat], op=op).wait()
            world = self.reduce.group_size
            full = torch.empty(world * part.numel(), dtype=tensor.dtype, device=tensor.device)
            self.gather.all_gather_coalesced_into([part], [full])
            flat.copy_(full[: flat.numel()])
        return TensorHandle("all_reduce", None, lambda: tensor)
