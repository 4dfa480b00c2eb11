"""Who is on which node, and the process groups ZeRO, MiCS and hpZ communicate over.

A :class:`Topology` is built once per communication context from the initialised
default process group. Ranks are numbered node-major: node ``n`` holds ranks
``n * ranks_per_node ... (n + 1) * ranks_per_node - 1`` (what torchrun does).
"""

from __future__ import annotations

import dataclasses
import enum
import os

import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm.checks import require_process_group

__all__ = ["HierarchicalGroups", "LinkKind", "Topology", "group_ranks", "group_size_and_rank"]

Partition = tuple[tuple[int, ...], ...]


class LinkKind(enum.Enum):
    """The slowest link a group's traffic crosses."""

    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group`` in group-rank order (``None`` is the world group)."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def group_size_and_rank(group: ProcessGroup | None, what: str) -> tuple[int, int]:
    """``(size, rank in group)``; a clear error if no process group exists or we are not a member."""
    require_process_group(what)
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if size < 1 or rank < 0:
        raise RuntimeError(
            f"{what}: global rank {dist.get_rank()} is not a member of the group it was given; "
            "pass the group that Topology built for this rank"
        )
    return size, rank


@dataclasses.dataclass(frozen=True)
class HierarchicalGroups:
    """The two hops of a hierarchical collective over one (shard) group.

    The group spans ``inter_size`` nodes with ``intra_size`` ranks on each; its
    group rank ``g`` is ``inter_rank * intra_size + intra_rank`` (node-major), which is
    how :meth:`Topology.hierarchical_groups` builds it.
    """

    inter: ProcessGroup
    intra: ProcessGroup

    @property
    def inter_size(self) -> int:
        """Number of nodes the group spans."""
        return dist.get_world_size(self.inter)

    @property
    def intra_size(self) -> int:
        """Number of group members per node."""
        return dist.get_world_size(self.intra)

    @property
    def size(self) -> int:
        """Number of ranks in the whole group."""
        return self.inter_size * self.intra_size

    @property
    def rank(self) -> int:
        """This rank's position in the whole group (node-major)."""
        return dist.get_rank(self.inter) * self.intra_size + dist.get_rank(self.intra)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the whole group in group-rank order."""
        inter, intra = group_ranks(self.inter), group_ranks(self.intra)
        mine = dist.get_rank()
        node_base = [r - mine for r in inter]
        return tuple(base + r for base in node_base for r in intra)


class Topology:
    """Nodes, ranks and cached process groups of one communication context."""

    __slots__ = ("_groups", "ranks_per_node", "rank", "world_size")

    def __init__(self, ranks_per_node: int | None = None) -> None:
        require_process_group("Topology()")
        self.world_size: int = dist.get_world_size()
        self.rank: int = dist.get_rank()
        self.ranks_per_node: int = _resolve_ranks_per_node(ranks_per_node, self.world_size)
        self._groups: dict[Partition, ProcessGroup] = {}

    def __repr__(self) -> str:
        return (
            f"Topology(world_size={self.world_size}, rank={self.rank}, "
            f"ranks_per_node={self.ranks_per_node}, num_nodes={self.num_nodes})"
        )

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """Index of this rank's node."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index on its node."""
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Index of the node holding global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return rank // self.ranks_per_node

    def link_kind(self, group: ProcessGroup | None) -> LinkKind:
        """``INTER_NODE`` if ``group``'s ranks span more than one node, else ``INTRA_NODE``."""
        nodes = {self.node_of(r) for r in group_ranks(group)}
        return LinkKind.INTER_NODE if len(nodes) > 1 else LinkKind.INTRA_NODE

    def intra_node_group(self) -> ProcessGroup:
        """The ranks on this rank's node."""
        return self._group(node_partition(self.world_size, self.ranks_per_node))

    def inter_node_group(self) -> ProcessGroup:
        """The ranks with this rank's local rank, one on each node."""
        return self._group(local_rank_partition(self.world_size, self.ranks_per_node))

    def shard_group(self, shard_size: int) -> ProcessGroup:
        """The ``shard_size`` consecutive ranks holding one copy of the sharded state (MiCS, hpZ).

        Raises:
            ValueError: ``shard_size < 1`` or it does not divide the world size.
        """
        return self._group(shard_partition(self.world_size, shard_size))

    def replicate_group(self, shard_size: int) -> ProcessGroup:
        """The ranks at this rank's position in every shard group (the replicas of its shard).

        Raises:
            ValueError: ``shard_size < 1`` or it does not divide the world size.
        """
        return self._group(replicate_partition(self.world_size, shard_size))

    def hierarchical_groups(self, shard_size: int) -> HierarchicalGroups:
        """The inter-node and intra-node hops inside the shard group containing this rank.

        Raises:
            ValueError: ``shard_size`` is invalid, or neither it nor ``ranks_per_node`` is a
                multiple of the other (the shard group would be ragged across nodes).
        """
        inter, intra = hierarchical_partitions(self.world_size, self.ranks_per_node, shard_size)
        return HierarchicalGroups(inter=self._group(inter), intra=self._group(intra))

    def _group(self, partition: Partition) -> ProcessGroup:
        group = self._groups.get(partition)
        if group is None:
            group = self._create(partition)
            self._groups[partition] = group
        return group

    def _create(self, partition: Partition) -> ProcessGroup:
        mine = next(ranks for ranks in partition if self.rank in ranks)
        if len(partition) == 1 and self.world_size > 1:
            # The whole world: a group of its own, not dist.group.WORLD (a reference to torch's
            # default group that outlives destroy_process_group() makes gloo abort at exit).
            return dist.new_group(list(mine))
        if all(len(ranks) == 1 for ranks in partition):
            # Every group of the kind is a single rank: nothing to agree on with other ranks.
            return dist.new_group([self.rank], use_local_synchronization=True)
        created = {ranks: dist.new_group(list(ranks)) for ranks in partition}  # same order on all ranks
        return created[mine]


def node_partition(world_size: int, ranks_per_node: int) -> Partition:
    """Ranks grouped by node: ``((0, .., rpn-1), (rpn, .., 2rpn-1), ...)``."""
    rpn = ranks_per_node
    return tuple(tuple(range(n * rpn, (n + 1) * rpn)) for n in range(world_size // rpn))


def local_rank_partition(world_size: int, ranks_per_node: int) -> Partition:
    """Ranks grouped by local rank: one rank per node in each group."""
    return tuple(tuple(range(lr, world_size, ranks_per_node)) for lr in range(ranks_per_node))


def _check_divisor(name: str, value: object, world_size: int, fix: str) -> int:
    """``value`` if it is an integer >= 1 dividing ``world_size``; else a ValueError naming ``name``."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if world_size % value:
        raise ValueError(f"{name}={value} does not divide the world size {world_size}: {fix}")
    return value


def shard_partition(world_size: int, shard_size: int) -> Partition:
    """Consecutive blocks of ``shard_size`` ranks.

    Raises:
        ValueError: ``shard_size < 1`` or it does not divide ``world_size``.
    """
    _check_divisor("shard_size", shard_size, world_size, "choose a divisor of the world size")
    count = world_size // shard_size
    return tuple(tuple(range(g * shard_size, (g + 1) * shard_size)) for g in range(count))


def replicate_partition(world_size: int, shard_size: int) -> Partition:
    """The ranks at the same position of every shard block (see :func:`shard_partition`)."""
    shards = shard_partition(world_size, shard_size)
    return tuple(tuple(s[i] for s in shards) for i in range(shard_size))


def hierarchical_partitions(
    world_size: int, ranks_per_node: int, shard_size: int
) -> tuple[Partition, Partition]:
    """``(inter, intra)`` hops of every shard block: same local rank across nodes / same node.

    Raises:
        ValueError: ``shard_size`` is invalid, or neither it nor ``ranks_per_node`` is a
            multiple of the other.
    """
    shards = shard_partition(world_size, shard_size)
    rpn = ranks_per_node
    if shard_size % rpn == 0:
        per_node = shard_size // rpn
        intra = tuple(tuple(s[n * rpn : (n + 1) * rpn]) for s in shards for n in range(per_node))
        inter = tuple(tuple(s[lr::rpn]) for s in shards for lr in range(rpn))
        return inter, intra
    if rpn % shard_size == 0:
        return tuple((r,) for r in range(world_size)), shards
    raise ValueError(
        f"hierarchical groups need shard_size={shard_size} and ranks_per_node={rpn} to be "
        "multiples of one another (otherwise shard groups straddle nodes unevenly)"
    )


def _resolve_ranks_per_node(explicit: int | None, world_size: int) -> int:
    source = "ranks_per_node"
    value: object = explicit
    if value is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return world_size
        source = "LOCAL_WORLD_SIZE"
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not an integer; unset it or fix it") from None
    return _check_divisor(source, value, world_size, "every node must hold the same number of ranks")
