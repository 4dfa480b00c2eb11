"""The row exchange of the padded reduce-scatter (one ``all_to_all_single`` plus a local sum)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.handles import ReduceScatterHandle
from zero_comm.ledger import record, ring_wire_bytes
from zero_comm.profiling import profile_range
from zero_comm.watched import watched_call

__all__ = [
    "ADD_CHAIN_MAX_ROWS",
    "RowExchange",
    "exchange_full",
    "exchange_rows",
    "interleave",
    "issue_staged_rows",
    "record_padded_reduce_scatter",
    "sum_rows",
]

ADD_CHAIN_MAX_ROWS = 4  # on CPU, row-by-row adds beat torch.sum(dim=0) up to here


@dataclasses.dataclass(frozen=True)
class RowExchange:
    """The buffers of one reduce-scatter over at most :data:`ADD_CHAIN_MAX_ROWS` ranks."""

    send: torch.Tensor
    recv: torch.Tensor
    splits: list[int]
    own: torch.Tensor | None
    own_writable: bool
    rank: int

    @classmethod
    def single(cls, tensor: torch.Tensor, world: int, rank: int) -> RowExchange:
        """The exchange of one tensor of ``world`` whole rows, sent as it is (no staging copy)."""
        total = tensor.numel() // world
        rows = tensor.view(world, total)
        if rank in (0, world - 1):  # the other rows lie back to back: send them as they are
            send = rows[1:] if rank == 0 else rows[:-1]
            others = [0 if r == rank else total for r in range(world)]
            return cls(send.reshape(-1), torch.empty_like(send), others, rows[rank], False, rank)
        return cls(tensor.view(-1), torch.empty_like(rows), [total] * world, None, False, rank)

    def reduce(self, average: bool) -> torch.Tensor:
        """The rows summed in rank order (averaged), as :func:`sum_rows` would: a view of one buffer."""
        world = len(self.splits)
        received = iter(self.recv)
        rows = [self.own if r == self.rank and self.own is not None else next(received) for r in range(world)]
        # a buffer of ours to sum into: x + y == y + x exactly, so either of the first two rows
        dst = rows[0] if self.rank != 0 or self.own_writable else rows[1]
        with profile_range("zero.reduce_scatter.local_sum"):
            if dst.dtype in (torch.float16, torch.bfloat16):
                return dst.copy_(_fp32_sum(rows, average))
            torch.add(rows[0], rows[1], out=dst)
            for r in range(2, world):
                dst.add_(rows[r])
            if average:
                dst.div_(world)
        return dst


def record_padded_reduce_scatter(
    group: ProcessGroup | None, numel: int, parts: list[int], world: int, like: torch.Tensor
) -> None:
    """Ledger entry of one padded reduce-scatter: ``numel`` elements of ``like``'s dtype in, the rows'
    ``world * sum(parts)`` elements on the ring."""
    es = like.element_size()
    record(
        "reduce_scatter",
        group,
        payload_bytes=numel * es,
        wire_bytes=ring_wire_bytes("reduce_scatter", world * sum(parts) * es, world),
    )


def issue_staged_rows(
    send: torch.Tensor,
    own: torch.Tensor | None,
    parts: list[int],
    rank: int,
    average: bool,
    group: ProcessGroup | None,
    async_op: bool,
) -> ReduceScatterHandle:
    """Exchange staged rows and sum them in rank order; ``wait()`` returns the padded partitions."""
    world = send.shape[0] + (own is not None)
    if world == 1:
        views = list(torch.split(send[0], parts))
        return ReduceScatterHandle("reduce_scatter", None, lambda: views)
    if own is None:
        out = torch.empty(sum(parts), dtype=send.dtype, device=send.device)
        return exchange_full(send, out, parts, average, group, async_op)
    others = [0 if r == rank else sum(parts) for r in range(world)]
    exchange = RowExchange(send.view(-1), torch.empty_like(send), others, own, True, rank)
    return exchange_rows(exchange, parts, average, group, async_op)


def exchange_rows(
    exchange: RowExchange, parts: list[int], average: bool, group: ProcessGroup | None, async_op: bool
) -> ReduceScatterHandle:
    """Send the exchange's rows with one ``all_to_all_single``; ``wait()`` sums them in rank order."""
    work = None
    if exchange.send.numel():
        work = watched_call(
            "reduce_scatter",
            dist.all_to_all_single,
            exchange.recv.view(-1),
            exchange.send,
            exchange.splits,
            exchange.splits,
            group=group,
            async_op=async_op,
        )

    def finish() -> list[torch.Tensor]:
        return list(torch.split(exchange.reduce(average), parts))

    return ReduceScatterHandle("reduce_scatter", work, finish, keepalive=(exchange.send,))


def exchange_full(
    send: torch.Tensor,
    out: torch.Tensor,
    parts: list[int],
    average: bool,
    group: ProcessGroup | None,
    async_op: bool,
) -> ReduceScatterHandle:
    """Every row exchanged (own included), summed by :func:`sum_rows` into ``out``."""
    recv = torch.empty_like(send)
    work = None
    if send.numel():
        work = watched_call(
            "reduce_scatter", dist.all_to_all_single, recv, send, group=group, async_op=async_op
        )

    def finish() -> list[torch.Tensor]:
        sum_rows(recv, out, average)
        return list(torch.split(out, parts))

    return ReduceScatterHandle("reduce_scatter", work, finish, keepalive=(send,))


def interleave(
    tensors: Sequence[torch.Tensor],
    parts: list[int],
    world: int,
    own: int | None,
    *,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, P)`` buffer whose rows hold partition ``r`` of every tensor, zero-padded, rank order.

    With ``own`` given, row ``own`` goes into a separate ``(P,)`` buffer (returned second)
    instead of the rows (``world - 1`` of them). Built by one ``torch.cat`` over slices (and
    zero pads) per buffer: one kernel, cheaper than a strided copy per tensor. With ``dtype``
    the buffers hold that dtype: the same ``torch.cat`` casts as it copies.
    """
    first = tensors[0]
    dtype = first.dtype if dtype is None else dtype
    flats = [t.view(-1) for t in tensors]
    pad = max((min(p, world * p - f.numel()) for f, p in zip(flats, parts)), default=0)
    zeros = torch.zeros(pad, dtype=first.dtype, device=first.device)

    def pieces(ranks: Sequence[int]) -> list[torch.Tensor]:
        found = []
        for r in ranks:
            for f, p in zip(flats, parts):
                n = f.numel()
                piece = f[min(r * p, n) : min((r + 1) * p, n)]
                found.append(piece)
                if piece.numel() < p:
                    found.append(zeros[: p - piece.numel()])
        return found

    rows = [r for r in range(world) if r != own]
    send = torch.empty(len(rows), sum(parts), dtype=dtype, device=first.device)
    sent = pieces(rows)
    if sent and send.numel():
        torch.cat(sent, out=send.view(-1))
    if own is None:
        return send, None
    mine = torch.empty(sum(parts), dtype=dtype, device=first.device)
    kept = pieces([own])
    if kept and mine.numel():
        torch.cat(kept, out=mine)
    return send, mine


def sum_rows(recv: torch.Tensor, out: torch.Tensor, average: bool) -> None:
    """``out = sum(recv, dim=0)`` (``/ rows`` if ``average``), accumulated in fp32 for half types.

    Rows are added in rank order, one vectorised add per row, which beats ``torch.sum`` over
    the outer dimension for few rows; many fp32 rows use ``torch.sum``.
    """
    rows = recv.shape[0]
    with profile_range("zero.reduce_scatter.local_sum"):
        if recv.dtype in (torch.float16, torch.bfloat16):
            out.copy_(_fp32_sum(recv, average))
            return
        if rows > ADD_CHAIN_MAX_ROWS:
            torch.sum(recv, dim=0, out=out)
        else:
            torch.add(recv[0], recv[1], out=out)
            for r in range(2, rows):
                out.add_(recv[r])
        if average:
            out.div_(rows)


def _fp32_sum(rows: Sequence[torch.Tensor], average: bool) -> torch.Tensor:
    """Half-precision rows added in rank order in fp32 (divided by their number if ``average``)."""
    acc = rows[0].float()
    for row in rows[1:]:
        acc.add_(row)
    if average:
        acc.div_(len(rows))
    return acc
