"""Which elements of each parameter this rank holds, in a stage-independent form."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

import zero_params
from zero_comm import partition_numel, shard_range

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from zero_optim import PartitionedOptimizer

__all__ = ["LocalPiece", "covered_prefix", "elementwise_state", "local_pieces"]


@dataclasses.dataclass(frozen=True)
class LocalPiece:
    """This rank's part of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    world: int
    rank: int
    group: ProcessGroup | None
    start: int
    stop: int
    padded: torch.Tensor
    optimizer_group: int | None
    offset: int

    @property
    def trainable(self) -> bool:
        """Whether the optimizer steps this parameter (it has an fp32 master and optimizer state)."""
        return self.optimizer_group is not None

    @property
    def partition_numel(self) -> int:
        """Elements per rank, padding included."""
        return partition_numel(self.numel, self.world)

    @property
    def real(self) -> torch.Tensor:
        """The real (unpadded) elements held here, as a view."""
        return self.padded.narrow(0, 0, self.stop - self.start)

    @property
    def writes(self) -> bool:
        """Whether this rank writes the piece to a checkpoint.

        Pieces of a partition world smaller than the process group (whole tensors, or
        replicas) are written once, by the ranks ``0 .. world - 1`` whose group rank equals
        their global rank; the save checks that the written pieces cover every parameter.
        Under MiCS these are the ranks of the first shard group: one copy per partition.
        """
        if self.world == _world_size():
            return True
        return dist.get_rank() < self.world and self.rank == dist.get_rank()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _optimizer_layout(
    optimizer: PartitionedOptimizer,
) -> tuple[int | None, int, ProcessGroup | None]:
    """``(world, rank, group)`` of a stage 0/1/2 partitioning (``world`` None when it does not say)."""
    part = optimizer.partitioning
    world = getattr(part, "world", None)
    return (
        (int(world) if world is not None else None),
        int(getattr(part, "rank", 0)),
        getattr(part, "group", None),
    )


def local_pieces(module: nn.Module, optimizer: PartitionedOptimizer) -> dict[str, LocalPiece]:
    """Every parameter's piece on this rank, keyed by qualified name, in ``named_parameters`` order.

    Raises:
        ValueError: a trainable parameter's partition size matches no known layout (a stage
            whose partitioning this checkpoint code does not understand).
    """
    segs = {}
    for gi, group in enumerate(optimizer.groups):
        for seg in group.segments:
            segs[id(seg.param)] = (gi, group, seg)
    opt_world, opt_rank, opt_group = _optimizer_layout(optimizer)
    pieces: dict[str, LocalPiece] = {}
    for name, p in module.named_parameters():
        found = segs.get(id(p))
        if zero_params.is_partitioned(p):
            st = zero_params.state_of(p)
            numel, world, rank, pg = st.numel, st.group_size, st.group_rank, st.group
            shape, dtype = tuple(st.shape), st.dtype
        else:
            numel, shape, dtype = p.numel(), tuple(p.shape), p.dtype
            if found is None:
                world, rank, pg = 1, 0, None
            elif opt_world is not None:
                world, rank, pg = opt_world, opt_rank, opt_group
            elif found[2].numel == numel:
                world, rank, pg = 1, 0, None
            else:
                world, rank, pg = _world_size(), dist.get_rank(), None
        if found is not None:
            gi, group, seg = found
            if seg.numel != partition_numel(numel, world):
                raise ValueError(
                    f"parameter {name!r}: its optimizer partition has {seg.numel} elements, but "
                    f"{numel} elements over {world} rank(s) give {partition_numel(numel, world)}; "
                    "this stage's layout is not the per-parameter layout checkpoints use"
                )
            padded, opt_index, offset = group.master_view(seg), gi, seg.offset
        else:
            padded = _frozen_values(p)
            opt_index, offset = None, 0
        start, stop = shard_range(numel, world, rank)
        pieces[name] = LocalPiece(
            name, shape, dtype, numel, world, rank, pg, start, stop, padded, opt_index, offset
        )
    return pieces


def _frozen_values(p: torch.Tensor) -> torch.Tensor:
    """A frozen parameter's local values: its shard (an int8-stored or offloaded shard through its
    home, dequantized: a copy that ``load`` writes back with ``ShardHome.replace``), or the whole tensor."""
    if not zero_params.is_partitioned(p):
        return p.detach().reshape(-1)
    state = zero_params.state_of(p)
    return state.offload.upload([state])[0] if state.offload is not None else state.shard


def elementwise_state(optimizer: PartitionedOptimizer, group_index: int) -> dict[str, torch.Tensor]:
    """The torch optimizer's per-element state of one group (tensors shaped like its flat master).

    Scalars (Adam's ``step``) are left out; see :func:`scalar_state`.
    """
    master = optimizer.groups[group_index].master
    state = optimizer.torch_optimizer.state.get(master, {})
    return {
        k: v
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == master.shape
    }


def covered_prefix(ranges: list[tuple[int, int]]) -> int:
    """How far ``[0, n)`` the pieces ``[start, stop)`` cover without a gap (their order does not matter)."""
    pos = 0
    for a, b in sorted(ranges):
        if a > pos:
            break
        pos = max(pos, b)
    return pos
