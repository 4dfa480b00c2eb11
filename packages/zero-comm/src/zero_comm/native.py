"""The backend's own reduce-scatter (``reduce_scatter_tensor``), and the choice of strategy per backend.

:class:`~zero_comm.AllToAllReduceScatter` exchanges rows with one ``all_to_all_single`` and sums
them locally: on gloo, which has no fast reduce-scatter, that is ring-ideal. NCCL reduces in its
ring while the data moves, with no extra ``(W - 1) / W`` receive buffer and no local pass over
the rows: :class:`NativeReduceScatter` hands it the same interleaved rows in one
``reduce_scatter_tensor``, reducing in ``reduce_dtype`` (fp32 for half-precision inputs, as the
exchange sums them). :func:`reduce_scatter_strategy` makes the choice once, from the group's
backend, where a caller builds its strategies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.coalesced import reduce_scatter_inputs
from zero_comm.handles import ReduceScatterHandle
from zero_comm.partition import partition_numel
from zero_comm.profiling import profile_range
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.row_exchange import interleave, issue_staged_rows, record_padded_reduce_scatter
from zero_comm.strategies import AllToAllReduceScatter, OnGroup
from zero_comm.watched import watched_call

__all__ = [
    "NATIVE_REDUCE_SCATTER_BACKENDS",
    "NativeReduceScatter",
    "has_native_reduce_scatter",
    "reduce_scatter_strategy",
]

NATIVE_REDUCE_SCATTER_BACKENDS = ("nccl", "xccl")
"""Backends whose ``reduce_scatter_tensor`` reduces on the wire (faster than an exchange plus a sum)."""

_HALF = (torch.float16, torch.bfloat16)


class NativeReduceScatter(OnGroup):
    """One ``reduce_scatter_tensor`` of the interleaved rows per call, reduced in ``reduce_dtype``.

    The rows are those of :func:`~zero_comm.issue_reduce_scatter` (row ``r``: every tensor's
    zero-padded partition ``r``) and the results the same padded partitions; only the reduction
    runs inside the backend. ``"avg"`` sums and divides by the group size (gloo has no native
    average), so at two ranks the results equal the exchange's bit for bit.
    """

    __slots__ = ("reduce_dtype",)

    def __init__(self, group: ProcessGroup | None = None, *, reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__(group)
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"NativeReduceScatter: reduce_dtype must be floating point, got {reduce_dtype}")
        self.reduce_dtype = reduce_dtype

    def _repr_fields(self) -> str:
        return f"{super()._repr_fields()}, reduce_dtype={self.reduce_dtype}"

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype inputs of ``dtype`` are reduced (and sent) in."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return torch.float32 if dtype in _HALF else dtype

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], *, op: ReduceOpLike = "avg", async_op: bool = False
    ) -> ReduceScatterHandle:
        """See :func:`zero_comm.coalesced.issue_reduce_scatter` (padded partitions)."""
        what = "reduce_scatter_coalesced"
        with profile_range("zero.reduce_scatter.issue"):
            world, _, reduction = reduce_scatter_inputs(tensors, self.group, op, what, require_1d=False)
            first = tensors[0]
            if not first.is_floating_point():
                raise ValueError(f"NativeReduceScatter: needs floating-point tensors, got {first.dtype}")
            parts = [partition_numel(t.numel(), world) for t in tensors]
            average = reduction is Reduction.AVG
            if world == 1:
                send, _ = interleave(tensors, parts, world, None)
                record_padded_reduce_scatter(self.group, sum(t.numel() for t in tensors), parts, world, first)
                return issue_staged_rows(send, None, parts, 0, average, self.group, async_op)
            wire = self.wire_dtype(first.dtype)
            rows, _ = interleave(tensors, parts, world, None, dtype=wire)  # cast as it is staged
            numel = sum(t.numel() for t in tensors)
            record_padded_reduce_scatter(self.group, numel, parts, world, rows)
            out = torch.empty(sum(parts), dtype=wire, device=first.device)
            work = watched_call(
                "reduce_scatter",
                dist.reduce_scatter_tensor,
                out,
                rows.view(-1),
                op=dist.ReduceOp.SUM,
                group=self.group,
                async_op=async_op,
            )

        def finish() -> list[torch.Tensor]:
            with profile_range("zero.reduce_scatter.finish"):
                if average:
                    out.div_(world)
                result = out if wire == first.dtype else out.to(first.dtype)
                return list(torch.split(result, parts))

        return ReduceScatterHandle("reduce_scatter", work, finish, keepalive=(rows,))


def has_native_reduce_scatter(backend: str) -> bool:
    """Whether ``backend`` (a name from ``dist.get_backend``, or a ``"cpu:gloo,cuda:nccl"`` mix)
    reduces on the wire."""
    names = [part.rsplit(":", 1)[-1].strip().lower() for part in str(backend).split(",")]
    return any(name in NATIVE_REDUCE_SCATTER_BACKENDS for name in names)


def reduce_scatter_strategy(
    group: ProcessGroup | None = None, *, backend: str | None = None, reduce_dtype: torch.dtype | None = None
) -> AllToAllReduceScatter | NativeReduceScatter:
    """The reduce-scatter for ``group``'s backend: native on NCCL (XCCL), the exchange elsewhere.

    Chosen once, where a caller builds its strategies; the exchange sums half types in fp32,
    so ``reduce_dtype`` only applies to the native one.
    """
    if has_native_reduce_scatter(backend if backend is not None else dist.get_backend(group)):
        return NativeReduceScatter(group, reduce_dtype=reduce_dtype)
    return AllToAllReduceScatter(group)
