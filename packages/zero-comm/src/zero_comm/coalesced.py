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
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from zero_comm.checks import check_flat_inputs
from zero_comm.handles import AllGatherHandle, CollectiveHandle, ReduceScatterHandle, T
from zero_comm.ledger import record, ring_wire_bytes
from zero_comm.partition import partition_numel, shard_range
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.topology import group_size_and_rank
from zero_comm.watchdog import watched_call

__all__ = [
    "GatherLayout",
    "StagedReduceScatter",
    "adjacent_flat_view",
    "all_gather_coalesced",
    "all_gather_coalesced_into",
    "issue_all_gather",
    "issue_all_gather_into",
    "issue_reduce_scatter",
    "reduce_scatter_coalesced",
    "reduce_scatter_coalesced_padded",
    "result_or_handle",
    "unpad_partitions",
]

_RS_OPS = (Reduction.SUM, Reduction.AVG)
_ADD_CHAIN_MAX_ROWS = 4  # measured on CPU: row-by-row adds beat torch.sum(dim=0) up to here


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
    with record_function("zero.all_gather.issue"):
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
        work = watched_call(
            "all_gather", dist.all_gather_single, layout.flat, shards[0], group=group, async_op=async_op
        )
        outputs = layout.outputs
        return AllGatherHandle("all_gather", work, lambda: outputs, keepalive=(shards[0],))
    send = adjacent_flat_view(shards)
    if send is None:
        send = torch.cat(list(shards))
    staging = torch.empty(world * total, dtype=send.dtype, device=send.device)
    work = watched_call("all_gather", dist.all_gather_single, staging, send, group=group, async_op=async_op)
    return AllGatherHandle(
        "all_gather", work, lambda: layout.copy_out(staging.view(world, total)), keepalive=(send,)
    )


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
    updated partitions.

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
    what = "all_gather_coalesced_into"
    with record_function("zero.all_gather.issue"):
        world, _ = group_size_and_rank(group, what)
        check_flat_inputs(shards, what, require_1d=True)
        check_gather_outputs(shards, outputs, world, what)
        sizes = [s.numel() for s in shards]
        total = sum(sizes)
        shard_bytes = total * shards[0].element_size()
        record(
            "all_gather",
            group,
            payload_bytes=shard_bytes,
            wire_bytes=ring_wire_bytes("all_gather", shard_bytes, world),
        )
        outs = list(outputs)
        if world == 1 or total == 0:
            for shard, out in zip(shards, outs):
                out.view(-1).copy_(shard[: out.numel()])
            return AllGatherHandle("all_gather", None, lambda: outs)
        if len(shards) == 1 and outs[0].numel() == world * total:
            # one tensor and no padding to drop: the collective writes straight into it
            work = dist.all_gather_single(outs[0].view(-1), shards[0], group=group, async_op=async_op)
            return AllGatherHandle("all_gather", work, lambda: outs, keepalive=(shards[0],))
        send = adjacent_flat_view(shards)
        if send is None:
            send = torch.cat(list(shards))
        staging = torch.empty(world, total, dtype=send.dtype, device=send.device)
        work = watched_call(
            "all_gather", dist.all_gather_single, staging.view(-1), send, group=group, async_op=async_op
        )

        def finish() -> list[torch.Tensor]:
            _copy_rows(staging, sizes, outs)
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


def _copy_rows(staging: torch.Tensor, sizes: list[int], outputs: list[torch.Tensor]) -> None:
    """Copy column block ``i`` of the rank-major ``staging`` (``(world, total)``) into ``outputs[i]``.

    Outputs that all hold their whole gathered tensor (padding included) take one fused
    ``split_with_sizes_copy``; otherwise one strided copy per output.
    """
    world = staging.shape[0]
    if all(out.numel() == world * n for n, out in zip(sizes, outputs)):
        dests = [out.view(world, n) for n, out in zip(sizes, outputs)]
        torch.split_with_sizes_copy(staging, sizes, dim=1, out=dests)
        return
    copy_columns_strided(staging, sizes, outputs)


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
    with record_function("zero.reduce_scatter.issue"):
        world, _ = group_size_and_rank(group, what)
        check_flat_inputs(tensors, what, require_1d=False)
        reduction = Reduction.parse(op, _RS_OPS, what)
        first = tensors[0]
        if reduction is Reduction.AVG and not (first.is_floating_point() or first.is_complex()):
            raise ValueError(
                f"{what}: op='avg' needs a floating-point dtype, got {first.dtype}; use op='sum'"
            )
        parts = [partition_numel(t.numel(), world) for t in tensors]
        es = first.element_size()
        padded_bytes = world * sum(parts) * es
        payload = sum(t.numel() for t in tensors) * es
        record(
            "reduce_scatter",
            group,
            payload_bytes=payload,
            wire_bytes=ring_wire_bytes("reduce_scatter", padded_bytes, world),
        )
        return _issue_reduce_scatter(tensors, parts, world, reduction, group, async_op)


def _issue_reduce_scatter(
    tensors: Sequence[torch.Tensor],
    parts: list[int],
    world: int,
    reduction: Reduction,
    group: ProcessGroup | None,
    async_op: bool,
) -> ReduceScatterHandle:
    first = tensors[0]
    if world == 1:
        out = torch.empty(sum(parts), dtype=first.dtype, device=first.device)
        torch.cat([t.view(-1) for t in tensors], out=out)
        views = list(torch.split(out, parts))
        return ReduceScatterHandle("reduce_scatter", None, lambda: views)
    if world > _ADD_CHAIN_MAX_ROWS:
        return _issue_reduce_scatter_full(tensors, parts, world, reduction, group, async_op)
    _, rank = group_size_and_rank(group, "reduce_scatter_coalesced")
    exchange = _Exchange.build(tensors, parts, world, rank)
    return _exchange_rows(exchange, parts, reduction is Reduction.AVG, group, async_op)


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """The buffers of one reduce-scatter over at most :data:`_ADD_CHAIN_MAX_ROWS` ranks.

    No rank sends its own partition to itself: ``send`` holds the rows of the other ranks
    (in rank order), ``recv`` receives theirs, and this rank's row (``own``) is read where it
    lies. A single unpadded tensor is sent as it is (no staging copy); several are
    interleaved into ``send`` and ``own``. The sum is accumulated in place into a row of
    ``recv`` (or ``own`` when it is staging): in flight a bucket holds its input (or its
    staging copy) and ``(W - 1) / W`` of it for the received rows, nothing more.

    Attributes:
        send: The rows sent, contiguous (for a single tensor whose own row lies between
            others: the whole tensor, own row included, with ``recv`` of ``W`` rows).
        recv: ``(R, P)`` rows received.
        splits: Elements exchanged with each rank (``all_to_all_single`` split sizes).
        own: This rank's row, or ``None`` when it arrives in ``recv``.
        own_writable: Whether ``own`` is a staging copy (the sum may be written into it).
        rank: This rank.
    """

    send: torch.Tensor
    recv: torch.Tensor
    splits: list[int]
    own: torch.Tensor | None
    own_writable: bool
    rank: int

    @classmethod
    def build(cls, tensors: Sequence[torch.Tensor], parts: list[int], world: int, rank: int) -> _Exchange:
        first = tensors[0]
        total = sum(parts)
        others = [0 if r == rank else total for r in range(world)]
        if len(tensors) == 1 and first.numel() == world * total:
            rows = first.view(world, total)
            if rank in (0, world - 1):  # the other rows lie back to back: send them as they are
                send = rows[1:] if rank == 0 else rows[:-1]
                recv = torch.empty_like(send)
                return cls(send.reshape(-1), recv, others, rows[rank], False, rank)
            recv = torch.empty_like(rows)
            return cls(first.view(-1), recv, [total] * world, None, False, rank)
        send, own = _interleave(tensors, parts, world, rank)
        return cls(send.view(-1), torch.empty_like(send), others, own, True, rank)

    def reduce(self, average: bool) -> torch.Tensor:
        """The rows summed in rank order (averaged), as :func:`_sum_rows` would: a view of one buffer."""
        world = len(self.splits)
        received = iter(self.recv)
        rows = [self.own if r == self.rank and self.own is not None else next(received) for r in range(world)]
        # a buffer of ours to sum into: x + y == y + x exactly, so either of the first two rows
        dst = rows[0] if self.rank != 0 or self.own_writable else rows[1]
        with record_function("zero.reduce_scatter.local_sum"):
            if dst.dtype in (torch.float16, torch.bfloat16):
                acc = rows[0].float()
                for r in range(1, world):
                    acc.add_(rows[r])
                if average:
                    acc.div_(world)
                return dst.copy_(acc)
            torch.add(rows[0], rows[1], out=dst)
            for r in range(2, world):
                dst.add_(rows[r])
            if average:
                dst.div_(world)
        return dst


class StagedReduceScatter:
    """A reduce-scatter whose staging buffer is filled one tensor at a time (contiguous gradients).

    :func:`issue_reduce_scatter` stages several tensors into one interleaved buffer when it
    is called, so until then the caller holds every input, and the inputs and their staging
    copy coexist. Here the staging rows are allocated up front and :meth:`put` copies each
    tensor's partitions into them as soon as it exists, after which the caller frees it:
    a bucket of gradients costs its staging buffer, one gradient at a time and, once
    issued, the ``(W - 1) / W`` rows received — DeepSpeed's ``contiguous_gradients``. The
    rows, the exchange and the rank-order sum are those of :func:`issue_reduce_scatter`, so
    the results are bit-identical to it (a tensor never put counts as zeros).

    Args:
        numels: Elements of each tensor, in order (identical on every rank).
        group: Process group (``None``: the world).
        dtype: dtype of the tensors.
        device: Where they live.
    """

    __slots__ = ("_filled", "_offsets", "_own", "_send", "group", "numels", "parts", "rank", "world")

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
        staged_rows = self.world if self.world == 1 or self.world > _ADD_CHAIN_MAX_ROWS else self.world - 1
        self._send = torch.empty(staged_rows, total, dtype=dtype, device=device)
        self._own: torch.Tensor | None = None
        if staged_rows != self.world:
            self._own = torch.empty(total, dtype=dtype, device=device)
        self._filled = [False] * len(self.numels)

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
        flat = None if tensor is None else tensor.reshape(-1)
        with torch.no_grad():
            for r in range(self.world):
                dst = self._row(r).narrow(0, off, part)
                start, stop = min(r * part, numel), min((r + 1) * part, numel)
                if flat is None or stop == start:
                    dst.zero_()
                    continue
                dst[: stop - start].copy_(flat[start:stop])
                dst[stop - start :].zero_()

    def issue(self, *, op: ReduceOpLike = "avg", async_op: bool = False) -> ReduceScatterHandle:
        """Reduce the staged tensors (those never put as zeros); the handle of :func:`issue_reduce_scatter`.

        ``wait()`` returns, per tensor, this rank's padded partition (views into one buffer).
        """
        what = "reduce_scatter_coalesced"
        with record_function("zero.reduce_scatter.issue"):
            reduction = Reduction.parse(op, _RS_OPS, what)
            for i, filled in enumerate(self._filled):
                if not filled:
                    self.put(i, None)
            es = self._send.element_size()
            record(
                "reduce_scatter",
                self.group,
                payload_bytes=sum(self.numels) * es,
                wire_bytes=ring_wire_bytes("reduce_scatter", self.world * sum(self.parts) * es, self.world),
            )
            parts, send, average = self.parts, self._send, reduction is Reduction.AVG
            if self.world == 1:
                views = list(torch.split(send[0], parts))
                return ReduceScatterHandle("reduce_scatter", None, lambda: views)
            if self._own is None:
                out = torch.empty(sum(parts), dtype=send.dtype, device=send.device)
                return _exchange_full(send, out, parts, average, self.group, async_op)
            others = [0 if r == self.rank else sum(parts) for r in range(self.world)]
            exchange = _Exchange(send.view(-1), torch.empty_like(send), others, self._own, True, self.rank)
            return _exchange_rows(exchange, parts, average, self.group, async_op)


def _exchange_rows(
    exchange: _Exchange, parts: list[int], average: bool, group: ProcessGroup | None, async_op: bool
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


def _exchange_full(
    send: torch.Tensor,
    out: torch.Tensor,
    parts: list[int],
    average: bool,
    group: ProcessGroup | None,
    async_op: bool,
) -> ReduceScatterHandle:
    """Every row exchanged (own included), summed by :func:`_sum_rows` into ``out``."""
    recv = torch.empty_like(send)
    work = None
    if send.numel():
        work = watched_call(
            "reduce_scatter", dist.all_to_all_single, recv, send, group=group, async_op=async_op
        )

    def finish() -> list[torch.Tensor]:
        _sum_rows(recv, out, average)
        return list(torch.split(out, parts))

    return ReduceScatterHandle("reduce_scatter", work, finish, keepalive=(send,))


def _issue_reduce_scatter_full(
    tensors: Sequence[torch.Tensor],
    parts: list[int],
    world: int,
    reduction: Reduction,
    group: ProcessGroup | None,
    async_op: bool,
) -> ReduceScatterHandle:
    """Many ranks: every row exchanged (own included) and summed by :func:`_sum_rows`."""
    first = tensors[0]
    out = torch.empty(sum(parts), dtype=first.dtype, device=first.device)
    send, _ = _interleave(tensors, parts, world, None)
    return _exchange_full(send, out, parts, reduction is Reduction.AVG, group, async_op)


def _interleave(
    tensors: Sequence[torch.Tensor], parts: list[int], world: int, own: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, P)`` buffer whose rows hold partition ``r`` of every tensor, zero-padded, rank order.

    With ``own`` given, row ``own`` goes into a separate ``(P,)`` buffer (returned second)
    instead of the rows (``world - 1`` of them). Built by one ``torch.cat`` over slices (and
    zero pads) per buffer: one kernel, cheaper than a strided copy per tensor.
    """
    first = tensors[0]
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
    send = torch.empty(len(rows), sum(parts), dtype=first.dtype, device=first.device)
    sent = pieces(rows)
    if sent and send.numel():
        torch.cat(sent, out=send.view(-1))
    if own is None:
        return send, None
    mine = torch.empty(sum(parts), dtype=first.dtype, device=first.device)
    kept = pieces([own])
    if kept and mine.numel():
        torch.cat(kept, out=mine)
    return send, mine


def _sum_rows(recv: torch.Tensor, out: torch.Tensor, average: bool) -> None:
    """``out = sum(recv, dim=0)`` (``/ rows`` if ``average``), accumulated in fp32 for half types.

    Rows are added in rank order, one vectorised add per row, which beats ``torch.sum`` over
    the outer dimension for few rows; many fp32 rows use ``torch.sum``.
    """
    rows = recv.shape[0]
    with record_function("zero.reduce_scatter.local_sum"):
        if recv.dtype in (torch.float16, torch.bfloat16):
            acc = recv[0].float()
            for r in range(1, rows):
                acc.add_(recv[r])
            if average:
                acc.div_(rows)
            out.copy_(acc)
            return
        if rows > _ADD_CHAIN_MAX_ROWS:
            torch.sum(recv, dim=0, out=out)
        else:
            torch.add(recv[0], recv[1], out=out)
            for r in range(2, rows):
                out.add_(recv[r])
        if average:
            out.div_(rows)
