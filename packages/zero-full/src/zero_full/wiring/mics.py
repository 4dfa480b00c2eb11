"""MiCS wiring: the shard and replicate groups and the gather strategy a config asks for."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.profiler import record_function

import zero_params
from zero_comm import (
    AllGatherStrategy,
    FlatAllGather,
    HierarchicalAllGather,
    Topology,
    broadcast,
    group_ranks,
)
from zero_full.config.zero_optimization import ZeroOptimizationConfig

__all__ = ["MicsGroups", "build_mics_groups", "check_mics_layout", "sync_replicas"]


@dataclasses.dataclass(frozen=True)
class MicsGroups:
    """The process groups and gather strategy of one MiCS configuration on this rank."""

    shard_size: int
    replicas: int
    shard: ProcessGroup
    replicate: ProcessGroup
    gather_strategy: AllGatherStrategy
    hierarchical: bool

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's shard group."""
        return group_ranks(self.shard)

    @property
    def replicate_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's replicate group."""
        return group_ranks(self.replicate)


def check_mics_layout(shard_size: int, hierarchical: bool, world_size: int, ranks_per_node: int) -> None:
    """Validate a MiCS layout against the world (what ``initialize`` / ``Init`` check first)."""
    if shard_size < 1:
        raise ValueError(
            f"mics_shard_size={shard_size} is not a valid shard group size: use an integer >= 1 "
            "(or -1 to turn MiCS off)"
        )
    if world_size % shard_size:
        raise ValueError(
            f"mics_shard_size={shard_size} does not divide world size {world_size}: choose a divisor "
            f"of {world_size} (e.g. the ranks per node, {ranks_per_node})"
        )
    if not hierarchical:
        return
    spans = max(
        len({r // ranks_per_node for r in range(g * shard_size, (g + 1) * shard_size)})
        for g in range(world_size // shard_size)
    )
    if spans < 2:
        raise ValueError(
            f"mics_hierarchical_params_gather needs a shard group spanning >= 2 nodes, but "
            f"mics_shard_size={shard_size} with {ranks_per_node} ranks per node keeps each shard group "
            f"on one node: set mics_shard_size to a multiple of {ranks_per_node} (at most {world_size}) "
            "or turn mics_hierarchical_params_gather off"
        )
    if shard_size % ranks_per_node:
        raise ValueError(
            f"mics_hierarchical_params_gather: mics_shard_size={shard_size} is not a multiple of the "
            f"{ranks_per_node} ranks per node, so shard groups straddle nodes unevenly; use a multiple "
            f"of {ranks_per_node}"
        )


def build_mics_groups(z: ZeroOptimizationConfig, topology: Topology) -> MicsGroups:
    """Validate and create this rank's MiCS groups (collective: every rank calls it, in the same order).

    Raises:
        ValueError: see :func:`check_mics_layout`.
    """
    shard_size = z.mics_shard_size
    hierarchical = bool(z.mics_hierarchical_params_gather)
    check_mics_layout(shard_size, hierarchical, topology.world_size, topology.ranks_per_node)
    shard = topology.shard_group(shard_size)
    replicate = topology.replicate_group(shard_size)
    strategy: AllGatherStrategy
    if hierarchical:
        strategy = HierarchicalAllGather(topology.hierarchical_groups(shard_size))
    else:
        strategy = FlatAllGather(shard)
    return MicsGroups(
        shard_size=shard_size,
        replicas=topology.world_size // shard_size,
        shard=shard,
        replicate=replicate,
        gather_strategy=strategy,
        hierarchical=hierarchical,
    )


def sync_replicas(model: nn.Module, groups: MicsGroups) -> None:
    """Make every replica's shards equal to replicate-rank 0's (one broadcast per dtype).

    ``zero_params.partition`` does not communicate, and a model built under ``Init`` is
    partitioned from each rank's own values, so ranks built with different seeds would start
    with different replicas. Whole (persistent) parameters are then re-assembled from the
    synchronised shards with ``zero_params.commit_shards``.
    """
    if groups.replicas == 1:
        return
    src = groups.replicate_ranks[0]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    persistent = []
    for p in dict.fromkeys(model.parameters()):
        if zero_params.is_partitioned(p):
            state = zero_params.state_of(p)
            if state.shard.numel():
                by_dtype.setdefault((state.shard.dtype, state.shard.device), []).append(state.shard)
            if state.persistent:
                persistent.append(p)
    with record_function("zero.mics.sync_replicas"), torch.no_grad():
        for shards in by_dtype.values():
            flat = broadcast(torch.cat([s.reshape(-1) for s in shards]), src, groups.replicate)
            for s, part in zip(shards, flat.split([s.numel() for s in shards]), strict=True):
                s.copy_(part.view_as(s))
        if persistent:
            zero_params.commit_shards(persistent)
