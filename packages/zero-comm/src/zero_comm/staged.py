"""A reduce-scatter whose staging rows are filled one tensor at a time (contiguous gradients)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from zero_comm.handles import ReduceScatterHandle
from zero_comm.partition import partition_numel
from zero_comm.profiling import profile_range
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.row_exchange import ADD_CHAIN_MAX_ROWS, issue_staged_rows, record_padded_reduce_scatter
from zero_comm.topology import group_size_and_rank

__all__ = ["StagedReduceScatter"]

_RS_OPS = (Reduction.SUM, Reduction.AVG)


class StagedReduceScatter:
    """A reduce-scatter whose staging buffer is filled one tensor at a time (contiguous gradients)."""

    __slots__ = ("_filled", "_offsets", "_own", "_rows", "_send", "group", "numels", "parts", "rank", "world")

    def __init__(
        self,
        numels: Sequence[int],
        group: ProcessGroup | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if not numels:
            raise ValueError("StagedReduceScatter needs at least one tensor")
        self.world, self.rank = group_size_and_rank(group, "reduce_scatter_coalesced")
        self.group = group
        self.numels = [int(n) for n in numels]
        self.parts = [partition_numel(n, self.world) for n in self.numels]
        self._offsets = [0]
        for part in self.parts[:-1]:
            self._offsets.append(self._offsets[-1] + part)
        total = sum(self.parts)
        staged_rows = self.world if self.world == 1 or self.world > ADD_CHAIN_MAX_ROWS else self.world - 1
        self._send = torch.empty(staged_rows, total, dtype=dtype, device=device)
        self._own: torch.Tensor | None = None
        if staged_rows != self.world:
            self._own = torch.empty(total, dtype=dtype, device=device)
        self._filled = [False] * len(self.numels)
        self._rows = [self._row(r) for r in range(self.world)]  # made once: put() runs per gradient

    def _row(self, r: int) -> torch.Tensor:
        """Staging row of rank ``r``'s partitions."""
        if self._own is None:
            return self._send[r]
        if r == self.rank:
            return self._own
        return self._send[r if r < self.rank else r - 1]

    def put(self, index: int, tensor: torch.Tensor | None) -> None:
        """Copy tensor ``index`` (``None``: zeros) into its staging positions; the caller may free it.

        Raises:
            ValueError: ``tensor`` has the wrong number of elements or was put before.
        """
        numel, part, off = self.numels[index], self.parts[index], self._offsets[index]
        if self._filled[index]:
            raise ValueError(f"StagedReduceScatter: tensor {index} was put twice")
        if tensor is not None and tensor.numel() != numel:
            raise ValueError(
                f"StagedReduceScatter: tensor {index} has {tensor.numel()} elements, expected {numel}"
            )
        self._filled[index] = True
        with torch.no_grad():
            if tensor is None:
                for row in self._rows:
                    row.narrow(0, off, part).zero_()
                return
            flat = tensor.reshape(-1)
            if numel == self.world * part:  # no padding: one copy per block of rows, not one per rank
                self._put_whole(flat.view(self.world, part), off, part)
                return
            for r, row in enumerate(self._rows):  # rank r's partition: elements [r * part, (r + 1) * part)
                dst = row.narrow(0, off, part)
                n = min(part, numel - r * part)  # its elements that exist (the rest is padding)
                if n == part:
                    dst.copy_(flat.narrow(0, r * part, part))
                elif n <= 0:
                    dst.zero_()
                else:
                    dst.narrow(0, 0, n).copy_(flat.narrow(0, r * part, n))
                    dst.narrow(0, n, part - n).zero_()

    def _put_whole(self, rows: torch.Tensor, off: int, part: int) -> None:
        """Copy ``(world, part)`` rows into the staging columns ``[off, off + part)``."""
        if self._own is None:
            self._send[:, off : off + part].copy_(rows)
            return
        r = self.rank
        self._own.narrow(0, off, part).copy_(rows[r])
        if r:
            self._send[:r, off : off + part].copy_(rows[:r])
        if r + 1 < self.world:
            self._send[r:, off : off + part].copy_(rows[r + 1 :])

    def fill_missing(self, count: int | None = None) -> None:
        """Zero the staging positions of every tensor (of the first ``count``) not put yet.

        :meth:`issue` does it for all of them.
        """
        for i, filled in enumerate(self._filled[:count]):
            if not filled:
                self.put(i, None)

    def staged_rows(self, count: int) -> list[torch.Tensor]:
        """Every rank's staged partitions of tensors ``[0, count)`` (views, this rank's own row included).

        What :meth:`issue` will send and sum for those tensors, e.g. to scan them once for a
        bound before the last tensor is put.
        """
        end = self._offsets[count] if count < len(self._offsets) else sum(self.parts)
        rows = [self._send[:, :end]]
        if self._own is not None:
            rows.append(self._own[:end])
        return rows

    def issue(self, *, op: ReduceOpLike = "avg", async_op: bool = False) -> ReduceScatterHandle:
        """Reduce the staged tensors (those never put: zeros); as :func:`~zero_comm.issue_reduce_scatter`.

        ``wait()`` returns, per tensor, this rank's padded partition (views into one buffer).
        """
        what = "reduce_scatter_coalesced"
        with profile_range("zero.reduce_scatter.issue"):
            reduction = Reduction.parse(op, _RS_OPS, what)
            self.fill_missing()
            record_padded_reduce_scatter(self.group, sum(self.numels), self.parts, self.world, self._send)
            average = reduction is Reduction.AVG
            return issue_staged_rows(
                self._send, self._own, self.parts, self.rank, average, self.group, async_op
            )
