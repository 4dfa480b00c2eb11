"""Coalesced collectives: many tensors, one collective.

* :func:`all_gather_coalesced` gathers every rank's 1-D shards of several tensors with
  one ``all_gather_single`` and returns the full tensors as views into one flat buffer.
* :func:`reduce_scatter_coalesced` reduces several tensors and leaves each rank its
  (unpadded, as DeepSpeed's) partition of each, with one ``all_to_all_single`` plus a local
  sum — the ring-ideal ``(W-1)/W`` of the input on the wire (gloo's own reduce-scatter sends
  twice that); :func:`reduce_scatter_coalesced_padded` keeps the zero-padded partitions of
  equal size that the optimizers store.

Like ``torch.distributed``, a call returns its result, and a :class:`~zero_comm.CollectiveHandle`
with ``.wait()`` only with ``async_op=True``. The ``issue_*`` functions always return the handle:
the strategy objects (:mod:`zero_comm.strategies`) are built on them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.checks import check_flat_inputs
from zero_comm.handles import AllGatherHandle, CollectiveHandle, ReduceScatterHandle, T
from zero_comm.ledger import record, ring_wire_bytes
from zero_comm.pairwise import exchange_with_peer, gather_rows, gathers_pairwise
from zero_comm.partition import partition_numel, shard_range
from zero_comm.profiling import profile_range
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.row_exchange import (
    ADD_CHAIN_MAX_ROWS,
    RowExchange,
    exchange_rows,
    interleave,
    issue_staged_rows,
    record_padded_reduce_scatter,
)
from zero_comm.topology import group_size_and_rank

__all__ = [
    "GatherIntoPlan",
    "GatherLayout",
    "adjacent_flat_view",
    "all_gather_coalesced",
    "all_gather_coalesced_into",
    "issue_all_gather",
    "issue_all_gather_into",
    "issue_reduce_scatter",
    "reduce_scatter_coalesced",
    "reduce_scatter_coalesced_padded",
    "reduce_scatter_inputs",
    "result_or_handle",
    "unpad_partitions",
]

_RS_OPS = (Reduction.SUM, Reduction.AVG)


@dataclasses.dataclass(frozen=True)
class GatherLayout:
    """Where the gathered tensors go: one flat buffer, tensor after tensor.

    Attributes:
        sizes: Shard numel of each input.
        world: Group size.
        flat: The output buffer of ``world * sum(sizes)`` elements.
        outputs: One view of ``world * sizes[i]`` elements per input, in order.
    """

    sizes: list[int]
    world: int
    flat: torch.Tensor
    outputs: list[torch.Tensor]

    @property
    def total(self) -> int:
        """Elements of one rank's concatenated shards."""
        return sum(self.sizes)

    @classmethod
    def plan(
        cls, shards: Sequence[torch.Tensor], world: int, out: torch.Tensor | None, what: str
    ) -> GatherLayout:
        """Validate ``out`` (or allocate it) and cut it into per-tensor views.

        Raises:
            ValueError: ``out`` has the wrong size, dtype, device, or is not a contiguous 1-D tensor.
        """
        sizes = [s.numel() for s in shards]
        need = world * sum(sizes)
        first = shards[0]
        if out is None:
            flat = torch.empty(need, dtype=first.dtype, device=first.device)
        else:
            _check_out(out, need, first, what)
            flat = out
        outputs = list(torch.split(flat, [world * n for n in sizes]))
        return cls(sizes, world, flat, outputs)

    def copy_out(self, rank_major: torch.Tensor) -> list[torch.Tensor]:
        """Reorder a rank-major gathered buffer into :attr:`outputs` with one fused copy.

        Args:
            rank_major: Shape ``(*group_dims, total)`` whose leading dims, flattened, run in
                group-rank order (it may be a permuted, non-contiguous view).
        """
        lead = rank_major.shape[:-1]
        dests = [o.view(*lead, n) for o, n in zip(self.outputs, self.sizes)]
        torch.split_with_sizes_copy(rank_major, self.sizes, dim=rank_major.dim() - 1, out=dests)
        return self.outputs


def _check_out(out: torch.Tensor, need: int, like: torch.Tensor, what: str) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"{what}: out must be a contiguous 1-D tensor, got shape {tuple(out.shape)}")
    if out.numel() != need:
        raise ValueError(
            f"{what}: out has {out.numel()} elements but needs {need} (group size x sum of shard numels)"
        )
    if out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{what}: out is {out.dtype} on {out.device} but the shards are {like.dtype} on {like.device}"
        )


def all_gather_coalesced(
    shards: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor] | AllGatherHandle:
    """Gather the shards of several tensors from every rank with one collective.

    See :func:`issue_all_gather` for the layout and the errors.

    Returns:
        Per input, the full 1-D tensor of ``world * shards[i].numel()`` elements in group-rank
        order (views into one flat buffer, ``out`` if given); with ``async_op=True`` the
        :class:`~zero_comm.AllGatherHandle` whose ``wait()`` returns them.
    """
    handle = issue_all_gather(shards, group, async_op=async_op, out=out)
    return result_or_handle(handle, async_op)


def result_or_handle(handle: CollectiveHandle[T], async_op: bool) -> T | CollectiveHandle[T]:
    """``handle`` itself with ``async_op``, else its result (``torch.distributed``'s convention)."""
    return handle if async_op else handle.wait()


def issue_all_gather(
    shards: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> AllGatherHandle:
    """Gather the shards of several tensors from every rank with one collective; always a handle.

    Each ``shards[i]`` is this rank's contiguous 1-D shard of tensor ``i`` and must have
    the same numel on every rank of ``group``. With one tensor the collective writes
    straight into the output. With several, the shards are concatenated (skipped when they
    already lie back to back in one buffer), gathered rank-major into a staging buffer
    (``(world, total)``) and reordered into the output by one fused
    ``torch.split_with_sizes_copy`` in :meth:`AllGatherHandle.wait`.

    Args:
        shards: This rank's shards (same dtype and device; zero-numel shards are allowed).
        group: Process group (``None``: the world). A one-rank group only copies.
        async_op: Return before the communication completes; ``wait()`` finishes it.
        out: Optional flat output buffer of ``world * sum(numels)`` elements.

    Returns:
        A handle whose ``wait()`` returns, per input, the full 1-D tensor of
        ``world * shards[i].numel()`` elements in group-rank order — views into one flat
        buffer (``out`` if given) laid out tensor after tensor.

    Raises:
        ValueError: empty list, mixed dtypes or devices, a non-contiguous or non-1-D shard,
            or a badly sized ``out``.
        RuntimeError: no process group is initialised.
    """
    what = "all_gather_coalesced"
    with profile_range("zero.all_gather.issue"):
        world, _ = group_size_and_rank(group, what)
        check_flat_inputs(shards, what, require_1d=True)
        layout = GatherLayout.plan(shards, world, out, what)
        shard_bytes = layout.total * shards[0].element_size()
        record(
            "all_gather",
            group,
            payload_bytes=shard_bytes,
            wire_bytes=ring_wire_bytes("all_gather", shard_bytes, world),
        )
        return _issue_gather(shards, layout, group, async_op)


def _issue_gather(
    shards: Sequence[torch.Tensor], layout: GatherLayout, group: ProcessGroup | None, async_op: bool
) -> AllGatherHandle:
    world, total = layout.world, layout.total
    if world == 1 or total == 0:
        if total:
            torch.cat(list(shards), out=layout.flat)
        outputs = layout.outputs
        return AllGatherHandle("all_gather", None, lambda: outputs)
    if len(shards) == 1:
        work = gather_rows(layout.flat, shards[0], group, async_op=async_op)
        outputs = layout.outputs
        return AllGatherHandle("all_gather", work, lambda: outputs, keepalive=(shards[0],))
    staging = torch.empty(world * total, dtype=shards[0].dtype, device=shards[0].device)
    send = _send_buffer(shards, staging.view(world, total), group)
    work = gather_rows(staging, send, group, async_op=async_op)
    return AllGatherHandle(
        "all_gather", work, lambda: layout.copy_out(staging.view(world, total)), keepalive=(send,)
    )


def _send_buffer(
    shards: Sequence[torch.Tensor], rows: torch.Tensor, group: ProcessGroup | None
) -> torch.Tensor:
    """This rank's gather input: its shards back to back (``rows`` is the ``(world, total)`` output).

    Shards already back to back in one buffer are sent as they lie. Otherwise they are
    concatenated, straight into this rank's own row of ``rows`` when :func:`gather_rows` runs a
    pairwise exchange (it then has nothing left to copy), into a buffer of their own when not.
    """
    send = adjacent_flat_view(shards)
    if send is not None:
        return send
    if gathers_pairwise(group, rows.device):
        own = rows[dist.get_rank(group)]
        torch.cat(list(shards), out=own)
        return own
    return torch.cat(list(shards))


def all_gather_coalesced_into(
    shards: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
) -> list[torch.Tensor] | AllGatherHandle:
    """:func:`all_gather_coalesced` writing each gathered tensor straight into a destination.

    See :func:`issue_all_gather_into` for the contract and the errors.

    Returns:
        ``outputs`` once filled; with ``async_op=True`` the handle whose ``wait()`` returns them.
    """
    handle = issue_all_gather_into(shards, outputs, group, async_op=async_op)
    return result_or_handle(handle, async_op)


def issue_all_gather_into(
    shards: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    async_op: bool = False,
) -> AllGatherHandle:
    """Each gathered tensor straight into a destination; always returns a handle.

    ``outputs[i]`` (contiguous, any shape, ``shards[i]``'s dtype and device) receives the
    first ``outputs[i].numel()`` elements of gathered tensor ``i`` — the padding beyond them
    is dropped. Every element is copied once, from the rank-major gathered buffer into its
    destination (one strided copy per tensor; none for a single unpadded tensor, which the
    collective fills directly), instead of through :func:`all_gather_coalesced`'s
    flat output and a second copy by the caller: e.g. whole parameters refreshed from their
    updated partitions. The same gather issued again and again is a :class:`GatherIntoPlan`.

    Args:
        shards: This rank's 1-D shards (as for :func:`all_gather_coalesced`).
        outputs: One destination per shard, at most ``world * shards[i].numel()`` elements.
        group: Process group (``None``: the world).
        async_op: Return before the communication completes; ``wait()`` finishes the copies.

    Returns:
        A handle whose ``wait()`` returns ``outputs``.

    Raises:
        ValueError: the inputs :func:`all_gather_coalesced` refuses, a different number of
            outputs and shards, or an output that is not contiguous, has another dtype or
            device, or more elements than its gathered tensor.
        RuntimeError: no process group is initialised.
    """
    return GatherIntoPlan(shards, outputs, group).issue(async_op=async_op)


class _Route(enum.Enum):
    """How a :class:`GatherIntoPlan` moves the rows (chosen once, when planned)."""

    LOCAL = "one rank or nothing to send: local copies"
    WHOLE = "one unpadded tensor: the collective fills it"
    PEER = "two gloo ranks, shards back to back: only the peer's row is staged"
    STAGED = "a staging buffer of every row, copied out"


class GatherIntoPlan:
    """:func:`issue_all_gather_into` of fixed shards into fixed outputs, checked and laid out once.

    A parameter store gathers the same tensors into the same destinations step after step.
    The plan validates them, picks the route (see :class:`_Route`) and makes every view of
    the outputs once; :meth:`issue` then runs only the collective, its record in the ledger
    and the copies. The shards and outputs keep the storages they were planned with: their
    values may change, and a storage may be resized to 0 bytes and back between issues (as
    ``zero_params.UnshardedStorage`` does); anything else needs a new plan. The outputs must
    hold their bytes when planned (the layout checks compare addresses).

    Args:
        shards: This rank's 1-D shards (as for :func:`issue_all_gather_into`).
        outputs: One destination per shard.
        group: Process group (``None``: the world).

    Raises:
        ValueError, RuntimeError: as :func:`issue_all_gather_into`.
    """

    __slots__ = (
        "_own",
        "_payload",
        "_peer",
        "_route",
        "_send",
        "_skip",
        "_wire",
        "group",
        "outputs",
        "rank",
        "shards",
        "sizes",
        "world",
    )

    def __init__(
        self,
        shards: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        group: ProcessGroup | None = None,
    ) -> None:
        what = "all_gather_coalesced_into"
        world, rank = group_size_and_rank(group, what)
        check_flat_inputs(shards, what, require_1d=True)
        check_gather_outputs(shards, outputs, world, what)
        self.group, self.world, self.rank = group, world, rank
        self.shards, self.outputs = list(shards), list(outputs)
        self.sizes = sizes = [s.numel() for s in shards]
        total = sum(sizes)
        self._payload = total * shards[0].element_size()
        self._wire = ring_wire_bytes("all_gather", self._payload, world)
        self._send: torch.Tensor | None = None
        self._own: list[torch.Tensor] = []
        self._peer: list[torch.Tensor] = []
        self._skip: int | None = None
        if world == 1 or total == 0:
            self._route = _Route.LOCAL
        elif len(shards) == 1 and self.outputs[0].numel() == world * total:
            self._route = _Route.WHOLE
        elif _shards_are_own_rows(shards, self.outputs, world, rank):
            self._route, self._skip = _Route.STAGED, rank
        elif self._plan_peer():
            self._route = _Route.PEER
        else:
            self._route = _Route.STAGED

    def __repr__(self) -> str:
        return f"GatherIntoPlan(tensors={len(self.sizes)}, route={self._route.name}, world={self.world})"

    def _plan_peer(self) -> bool:
        """Two gloo ranks, shards back to back, whole outputs not sharing the shards' buffer:
        the shards are sent as they lie and copied straight into this rank's rows of the
        outputs (one fused copy, while the exchange runs); only the other rank's row is staged."""
        send = adjacent_flat_view(self.shards)
        if send is None or not gathers_pairwise(self.group, send.device):
            return False
        if any(out.numel() != 2 * n for n, out in zip(self.sizes, self.outputs)):
            return False
        storage = send.untyped_storage().data_ptr()
        if any(out.untyped_storage().data_ptr() == storage for out in self.outputs):
            return False  # an output shares the shards' buffer: written only once the exchange is done
        rank = self.rank
        self._send = send
        self._own = [out.view(2, n)[rank : rank + 1] for n, out in zip(self.sizes, self.outputs)]
        self._peer = [out.view(2, n)[1 - rank : 2 - rank] for n, out in zip(self.sizes, self.outputs)]
        return True

    def issue(self, *, async_op: bool = True) -> AllGatherHandle:
        """Issue the gather; the handle's ``wait()`` finishes the copies and returns the outputs."""
        with profile_range("zero.all_gather.issue"):
            record("all_gather", self.group, payload_bytes=self._payload, wire_bytes=self._wire)
            outs = self.outputs
            route = self._route
            if route is _Route.PEER:
                return self._issue_peer(async_op)
            if route is _Route.LOCAL:
                for shard, out in zip(self.shards, outs):
                    out.view(-1).copy_(shard[: out.numel()])
                return AllGatherHandle("all_gather", None, lambda: outs)
            if route is _Route.WHOLE:
                work = gather_rows(outs[0].view(-1), self.shards[0], self.group, async_op=async_op)
                return AllGatherHandle("all_gather", work, lambda: outs, keepalive=(self.shards[0],))
            return self._issue_staged(async_op)

    def _issue_peer(self, async_op: bool) -> AllGatherHandle:
        send = self._send
        peer = torch.empty(send.numel(), dtype=send.dtype, device=send.device)
        work = exchange_with_peer(peer, send, self.group, async_op=async_op)
        torch.split_with_sizes_copy(send.view(1, -1), self.sizes, dim=1, out=self._own)
        outs = self.outputs

        def finish() -> list[torch.Tensor]:
            torch.split_with_sizes_copy(peer.view(1, -1), self.sizes, dim=1, out=self._peer)
            return outs

        return AllGatherHandle("all_gather", work, finish, keepalive=(send, peer))

    def _issue_staged(self, async_op: bool) -> AllGatherHandle:
        first = self.shards[0]
        staging = torch.empty(self.world, sum(self.sizes), dtype=first.dtype, device=first.device)
        send = _send_buffer(self.shards, staging, self.group)
        work = gather_rows(staging.view(-1), send, self.group, async_op=async_op)
        outs, sizes, skip = self.outputs, self.sizes, self._skip

        def finish() -> list[torch.Tensor]:
            _copy_rows(staging, sizes, outs, skip)
            return outs

        return AllGatherHandle("all_gather", work, finish, keepalive=(send,))


def check_gather_outputs(
    shards: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    world: int,
    what: str,
    *,
    same_dtype: bool = True,
) -> None:
    """Raise ValueError unless ``outputs`` can take the gathered ``shards`` (one each, at most all of it).

    Each output is contiguous, on its shard's device (and of its dtype with ``same_dtype``; a
    casting gather passes ``False``) and holds at most ``world`` x its shard's elements.
    """
    if len(outputs) != len(shards):
        raise ValueError(f"{what}: {len(outputs)} outputs for {len(shards)} shards; pass one per shard")
    for i, (shard, out) in enumerate(zip(shards, outputs)):
        if not isinstance(out, torch.Tensor) or not out.is_contiguous():
            raise ValueError(f"{what}: outputs[{i}] must be a contiguous torch.Tensor")
        if (same_dtype and out.dtype != shard.dtype) or out.device != shard.device:
            raise ValueError(
                f"{what}: outputs[{i}] is {out.dtype} on {out.device} but its shard is {shard.dtype} "
                f"on {shard.device}"
            )
        if out.numel() > world * shard.numel():
            raise ValueError(
                f"{what}: outputs[{i}] has {out.numel()} elements, more than the {world * shard.numel()} "
                "gathered (group size x shard numel)"
            )


def _shards_are_own_rows(
    shards: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], world: int, rank: int
) -> bool:
    """Whether every shard already lies in its output, as row ``rank`` of its ``world`` rows.

    A parameter whose partitions live in its own padded buffer (stages 1 and 2) gathers from
    where its updated partition lies: that row needs no copy back.
    """
    for shard, out in zip(shards, outputs, strict=True):
        n = shard.numel()
        if out.numel() != world * n or out.view(-1)[rank * n :].data_ptr() != shard.data_ptr():
            return False
    return True


def _copy_rows(
    staging: torch.Tensor, sizes: list[int], outputs: list[torch.Tensor], skip: int | None = None
) -> None:
    """Copy column block ``i`` of the rank-major ``staging`` (``(world, total)``) into ``outputs[i]``.

    Outputs that all hold their whole gathered tensor (padding included) take one fused
    ``split_with_sizes_copy``; otherwise one strided copy per output. With ``skip`` (every
    output holding its whole tensor, its row ``skip`` already in place) the rows before and
    the rows after it are copied, one fused ``split_with_sizes_copy`` per block.
    """
    world = staging.shape[0]
    if skip is not None:
        for lo, hi in ((0, skip), (skip + 1, world)):
            if hi > lo:
                _copy_row_block(staging[lo:hi], lo, world, sizes, outputs)
        return
    if all(out.numel() == world * n for n, out in zip(sizes, outputs)):
        dests = [out.view(world, n) for n, out in zip(sizes, outputs)]
        torch.split_with_sizes_copy(staging, sizes, dim=1, out=dests)
        return
    copy_columns_strided(staging, sizes, outputs)


def _copy_row_block(
    block: torch.Tensor, first: int, world: int, sizes: list[int], outputs: Sequence[torch.Tensor]
) -> None:
    """Copy ``block`` (rows ``first, first + 1, ...`` of a rank-major gathered buffer) into the outputs.

    Each output holds its whole gathered tensor (``world`` rows of ``sizes[i]``); one fused
    ``split_with_sizes_copy``.
    """
    rows = block.shape[0]
    dests = [out.view(world, n)[first : first + rows] for n, out in zip(sizes, outputs)]
    torch.split_with_sizes_copy(block, sizes, dim=1, out=dests)


def copy_columns_strided(staging: torch.Tensor, sizes: list[int], outputs: Sequence[torch.Tensor]) -> None:
    """Copy column block ``i`` of the rank-major ``staging`` into ``outputs[i]``, one strided copy each.

    ``outputs[i]`` takes the first ``outputs[i].numel()`` elements of its block read rank by rank
    (its whole gathered tensor, or less when the padding is left out), cast to its dtype.
    """
    offset = 0
    for n, out in zip(sizes, outputs):
        flat = out.view(-1)
        numel = flat.numel()
        rows = numel // n if n else 0
        if rows:
            flat[: rows * n].view(rows, n).copy_(staging[:rows, offset : offset + n])
        rest = numel - rows * n
        if rest:
            flat[rows * n :].copy_(staging[rows, offset : offset + rest])
        offset += n


def adjacent_flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view spanning ``tensors`` if they already lie back to back in one storage.

    Shards kept in one flat buffer (as a parameter store may do) then need no
    concatenation before the collective. Returns ``None`` otherwise.
    """
    located = [t for t in tensors if t.numel()]
    if not located:
        return None
    first = located[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for t in located:
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != expected:
            return None
        expected += t.numel() * t.element_size()
    return first.as_strided((sum(t.numel() for t in located),), (1,))


def reduce_scatter_coalesced(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    op: ReduceOpLike = "avg",
    async_op: bool = False,
) -> list[torch.Tensor] | ReduceScatterHandle:
    """Reduce several tensors over ``group`` and keep this rank's unpadded partition of each.

    DeepSpeed's ``reduce_scatter_coalesced``: tensor ``i`` (flattened, ``numel`` elements) is
    split into partitions of ``partition_numel(numel, world)`` elements and this rank keeps the
    real elements of its own, :func:`~zero_comm.shard_range` ``(numel, world, rank)``: for 3
    elements over 2 ranks, 2 on rank 0 and 1 on rank 1; a tensor smaller than the group gives
    the last ranks empty partitions. The collective is the one of :func:`issue_reduce_scatter`.

    Args:
        tensors: Tensors of any shape (same dtype and device, contiguous), identical in
            shape on every rank of the group.
        group: Process group (``None``: the world). A one-rank group only copies.
        op: ``"sum"`` or ``"avg"`` (or the matching ``dist.ReduceOp``).
        async_op: Return the :class:`~zero_comm.ReduceScatterHandle` instead of the result.

    Returns:
        Per input, this rank's reduced partition without padding (1-D views into one buffer);
        with ``async_op=True`` the handle whose ``wait()`` returns them.

    Raises:
        ValueError: the input errors of :func:`issue_reduce_scatter`.
        RuntimeError: no process group is initialised.
    """
    handle = issue_reduce_scatter(tensors, group, op=op, async_op=async_op)
    world, rank = group_size_and_rank(group, "reduce_scatter_coalesced")
    numels = [t.numel() for t in tensors]
    return result_or_handle(handle.then(lambda parts: unpad_partitions(parts, numels, world, rank)), async_op)


def reduce_scatter_coalesced_padded(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    op: ReduceOpLike = "avg",
    async_op: bool = False,
) -> list[torch.Tensor] | ReduceScatterHandle:
    """:func:`reduce_scatter_coalesced` keeping the zero-padded partitions (all of one size per tensor).

    The form partitioned optimizers store: every rank's partition of tensor ``i`` has
    ``partition_numel(numel, world)`` elements, the positions past the tensor's end are zero.

    Returns:
        Per input, this rank's padded partition; with ``async_op=True`` the handle.
    """
    return result_or_handle(issue_reduce_scatter(tensors, group, op=op, async_op=async_op), async_op)


def unpad_partitions(
    parts: Sequence[torch.Tensor], numels: Sequence[int], world: int, rank: int
) -> list[torch.Tensor]:
    """The real elements of padded partitions: ``parts[i][: stop - start]`` of ``shard_range``."""
    out = []
    for part, numel in zip(parts, numels, strict=True):
        start, stop = shard_range(numel, world, rank)
        out.append(part[: stop - start])
    return out


def reduce_scatter_inputs(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup | None,
    op: ReduceOpLike,
    what: str,
    *,
    require_1d: bool,
) -> tuple[int, int, Reduction]:
    """Group size, this rank and the reduction of a reduce-scatter call, once its inputs are checked.

    Raises:
        ValueError: the errors of :func:`~zero_comm.checks.check_flat_inputs`, or an ``op``
            other than ``"sum"`` / ``"avg"``.
        RuntimeError: no process group is initialised.
    """
    world, rank = group_size_and_rank(group, what)
    check_flat_inputs(tensors, what, require_1d=require_1d)
    return world, rank, Reduction.parse(op, _RS_OPS, what)


def issue_reduce_scatter(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    op: ReduceOpLike = "avg",
    async_op: bool = False,
) -> ReduceScatterHandle:
    """Reduce several tensors over ``group``, keep this rank's padded partition; always a handle.

    Each tensor is flattened and split into ``world`` partitions of
    ``partition_numel(numel, world)`` elements (the last ones zero-padded); the partitions are
    interleaved into one ``(world, P)`` buffer (row ``r`` holds every tensor's partition ``r``),
    exchanged with one ``all_to_all_single`` and summed locally over the world dimension.
    bf16 / fp16 inputs are summed in fp32 and cast back; ``"avg"`` divides by the group size.

    Args:
        tensors: Tensors of any shape (same dtype and device, contiguous), identical in
            shape on every rank of the group.
        group: Process group (``None``: the world). A one-rank group only copies.
        op: ``"sum"`` or ``"avg"`` (or the matching ``dist.ReduceOp``).
        async_op: Return before the communication completes; ``wait()`` finishes it.

    Returns:
        A handle whose ``wait()`` returns, per input, this rank's reduced partition: a 1-D
        tensor of ``partition_numel`` elements (padding positions are zero), all views
        into one flat buffer.

    Raises:
        ValueError: empty list, mixed dtypes or devices, a non-contiguous tensor, an
            unsupported ``op``, or ``"avg"`` on an integer dtype.
        RuntimeError: no process group is initialised.
    """
    what = "reduce_scatter_coalesced"
    with profile_range("zero.reduce_scatter.issue"):
        world, rank, reduction = reduce_scatter_inputs(tensors, group, op, what, require_1d=False)
        first = tensors[0]
        if reduction is Reduction.AVG and not (first.is_floating_point() or first.is_complex()):
            raise ValueError(
                f"{what}: op='avg' needs a floating-point dtype, got {first.dtype}; use op='sum'"
            )
        parts = [partition_numel(t.numel(), world) for t in tensors]
        record_padded_reduce_scatter(group, sum(t.numel() for t in tensors), parts, world, first)
        average = reduction is Reduction.AVG
        if world == 1 or world > ADD_CHAIN_MAX_ROWS:
            send, _ = interleave(tensors, parts, world, None)
            return issue_staged_rows(send, None, parts, rank, average, group, async_op)
        if len(tensors) == 1 and first.numel() == world * sum(parts):
            return exchange_rows(RowExchange.single(first, world, rank), parts, average, group, async_op)
        send, own = interleave(tensors, parts, world, rank)
        return issue_staged_rows(send, own, parts, rank, average, group, async_op)
