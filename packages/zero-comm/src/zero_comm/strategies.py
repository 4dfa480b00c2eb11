"""Collective strategies: what a parameter or gradient store holds instead of flags.

:class:`AllGatherStrategy` and :class:`ReduceScatterStrategy` are the protocols;
:class:`FlatAllGather`, :class:`HierarchicalAllGather` and :class:`AllToAllReduceScatter`
are the implementations here. Other variants (e.g. quantized qwZ / qgZ) are new classes
in their own modules that satisfy the same protocols — no caller changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch.distributed import ProcessGroup

from zero_comm.coalesced import GatherIntoPlan, issue_all_gather, issue_all_gather_into, issue_reduce_scatter
from zero_comm.handles import AllGatherHandle, ReduceScatterHandle
from zero_comm.hierarchical import issue_hierarchical_all_gather
from zero_comm.reduction import ReduceOpLike
from zero_comm.topology import HierarchicalGroups, group_size_and_rank

__all__ = [
    "AllGatherStrategy",
    "AllToAllReduceScatter",
    "FlatAllGather",
    "GroupPosition",
    "HierarchicalAllGather",
    "ReduceScatterStrategy",
]


@runtime_checkable
class GroupPosition(Protocol):
    """What every strategy tells about the fixed group it runs over.

    Attributes:
        group_size: Ranks in the group (the shard / partition count of each tensor).
        group_rank: This rank's position in the group (which shard it owns, which partition it keeps).
    """

    group_size: int
    group_rank: int


@runtime_checkable
class AllGatherStrategy(GroupPosition, Protocol):
    """Gathers 1-D shards over a fixed group of ``group_size`` ranks (this rank owns shard ``group_rank``)."""

    def all_gather_coalesced(
        self, shards: Sequence[torch.Tensor], *, async_op: bool = False, out: torch.Tensor | None = None
    ) -> AllGatherHandle:
        """Same contract as :func:`zero_comm.coalesced.issue_all_gather` over this strategy's group.

        Always returns the handle (``async_op`` only says whether the communication may still
        be in flight).
        """
        ...


@runtime_checkable
class ReduceScatterStrategy(GroupPosition, Protocol):
    """Reduces tensors over a fixed group of ``group_size`` ranks; keeps partition ``group_rank`` of each."""

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], *, op: ReduceOpLike = "avg", async_op: bool = False
    ) -> ReduceScatterHandle:
        """Same contract as :func:`zero_comm.coalesced.issue_reduce_scatter` over this strategy's group.

        Always returns the handle; its partitions are padded to one size per tensor (what
        partitioned optimizers store), unlike :func:`zero_comm.reduce_scatter_coalesced`'s.
        """
        ...


class OnGroup:
    """Base of the strategies that run over one process group: the group, its size and this rank in it.

    ``repr`` is ``<class>(<fields>)`` with the fields of :meth:`_repr_fields`; a subclass adds its own.

    Args:
        group: Process group (``None``: the world).

    Raises:
        RuntimeError: no process group is initialised, or this rank is not in ``group``.
    """

    __slots__ = ("group", "group_rank", "group_size")

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group
        self.group_size, self.group_rank = group_size_and_rank(group, type(self).__name__)

    def _repr_fields(self) -> str:
        return f"group_size={self.group_size}, group_rank={self.group_rank}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_fields()})"


class FlatAllGather(OnGroup):
    """One ``all_gather_single`` over ``group`` per call.

    Args:
        group: Process group (``None``: the world).
    """

    __slots__ = ()

    def all_gather_coalesced(
        self, shards: Sequence[torch.Tensor], *, async_op: bool = False, out: torch.Tensor | None = None
    ) -> AllGatherHandle:
        """See :func:`zero_comm.coalesced.issue_all_gather`."""
        return issue_all_gather(shards, self.group, async_op=async_op, out=out)

    def all_gather_coalesced_into(
        self, shards: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *, async_op: bool = False
    ) -> AllGatherHandle:
        """See :func:`zero_comm.all_gather_coalesced_into`: each gathered tensor into its destination.

        Optional for an :class:`AllGatherStrategy`: a parameter store that keeps one storage per
        tensor uses it when the strategy has it, and gathers into a flat buffer plus a copy when not.
        """
        return issue_all_gather_into(shards, outputs, self.group, async_op=async_op)

    def plan_gather_into(
        self, shards: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> GatherIntoPlan:
        """:meth:`all_gather_coalesced_into` of the same shards and outputs, planned once to be issued
        many times (see :class:`zero_comm.GatherIntoPlan`).

        Optional for an :class:`AllGatherStrategy`: a parameter store that gathers the same
        parameters again and again plans them when the strategy has it.
        """
        return GatherIntoPlan(shards, outputs, self.group)


class HierarchicalAllGather:
    """Two-hop gather (inter-node, then intra-node) over a group spanning several nodes.

    Args:
        groups: The hops, from :meth:`zero_comm.Topology.hierarchical_groups`.
    """

    __slots__ = ("group_rank", "group_size", "groups")

    def __init__(self, groups: HierarchicalGroups) -> None:
        group_size_and_rank(groups.inter, "HierarchicalAllGather")
        self.groups = groups
        self.group_size = groups.size
        self.group_rank = groups.rank

    def __repr__(self) -> str:
        return (
            f"HierarchicalAllGather(nodes={self.groups.inter_size}, per_node={self.groups.intra_size}, "
            f"group_rank={self.group_rank})"
        )

    def all_gather_coalesced(
        self, shards: Sequence[torch.Tensor], *, async_op: bool = False, out: torch.Tensor | None = None
    ) -> AllGatherHandle:
        """See :func:`zero_comm.hierarchical.issue_hierarchical_all_gather`."""
        return issue_hierarchical_all_gather(shards, self.groups, async_op=async_op, out=out)


class AllToAllReduceScatter(OnGroup):
    """Reduce-scatter as one ``all_to_all_single`` plus a local sum (ring-ideal bytes).

    Args:
        group: Process group (``None``: the world).
    """

    __slots__ = ()

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], *, op: ReduceOpLike = "avg", async_op: bool = False
    ) -> ReduceScatterHandle:
        """See :func:`zero_comm.coalesced.issue_reduce_scatter` (padded partitions)."""
        return issue_reduce_scatter(tensors, self.group, op=op, async_op=async_op)
