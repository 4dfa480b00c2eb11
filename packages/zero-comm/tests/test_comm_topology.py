"""Topology: node arithmetic, group membership (checked by real collectives), errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from comm_cases import over_worlds

from zero_comm import LinkKind, Topology, all_gather_coalesced, group_ranks


def _members(group) -> list[int]:
    """Group membership measured by a collective: every member's global rank."""
    mine = torch.tensor([float(tdist.get_rank())])
    return [int(x) for x in all_gather_coalesced([mine], group)[0].tolist()]


def _topology_layout(rank, ranks_per_node):
    topo = Topology(ranks_per_node=ranks_per_node)
    world, rpn, r = rank.world_size, topo.ranks_per_node, rank.rank
    node, local = r // rpn, r % rpn
    assert (topo.world_size, topo.rank, topo.num_nodes) == (world, r, world // rpn)
    assert (topo.node, topo.local_rank) == (node, local)
    assert [topo.node_of(x) for x in range(world)] == [x // rpn for x in range(world)]
    intra, inter = topo.intra_node_group(), topo.inter_node_group()
    assert _members(intra) == list(range(node * rpn, (node + 1) * rpn))
    assert _members(inter) == list(range(local, world, rpn))
    assert topo.link_kind(intra) is LinkKind.INTRA_NODE
    assert topo.link_kind(inter) is (LinkKind.INTER_NODE if topo.num_nodes > 1 else LinkKind.INTRA_NODE)
    assert topo.intra_node_group() is intra  # cached
    for shard in [d for d in (1, 2, 4) if world % d == 0]:
        g = r // shard
        assert _members(topo.shard_group(shard)) == list(range(g * shard, (g + 1) * shard))
        assert _members(topo.replicate_group(shard)) == list(range(r % shard, world, shard))
        if shard % rpn == 0 or rpn % shard == 0:
            hops = topo.hierarchical_groups(shard)
            assert hops.ranks == tuple(range(g * shard, (g + 1) * shard))
            assert hops.rank == r - g * shard and hops.size == shard
            assert _members(hops.intra) == [x for x in hops.ranks if x // rpn == node]
            assert _members(hops.inter) == [x for x in hops.ranks if x % rpn == local]
    if world == rpn:  # the whole world: a group of its own, never torch's default group object
        assert intra is not tdist.group.WORLD and _members(intra) == list(range(world))
    return group_ranks(topo.shard_group(world))


def _layouts(rank):
    # Pool's own ranks_per_node, then every rank its own node, then one node.
    return [_topology_layout(rank, rpn) for rpn in (None, 1, rank.world_size)]


@over_worlds
def test_groups_contain_the_right_ranks(dist, spec):
    world, rpn = spec
    results = dist.run(world, _layouts, ranks_per_node=rpn)
    assert results == [[tuple(range(world))] * 3] * world


def _env_and_errors(rank):
    topo = Topology()  # LOCAL_WORLD_SIZE from the pool
    found = topo.ranks_per_node
    with pytest.raises(
        ValueError, match=f"ranks_per_node=3 does not divide the world size {rank.world_size}"
    ):
        Topology(ranks_per_node=3)
    with pytest.raises(ValueError, match="ranks_per_node must be an integer >= 1, got 0"):
        Topology(ranks_per_node=0)
    with pytest.raises(ValueError, match=f"shard_size=3 does not divide the world size {rank.world_size}"):
        topo.shard_group(3)
    with pytest.raises(ValueError, match="shard_size must be an integer >= 1, got 0"):
        topo.replicate_group(0)
    with pytest.raises(ValueError, match=f"rank {rank.world_size} is outside the world"):
        topo.node_of(rank.world_size)
    return found


@over_worlds
def test_ranks_per_node_comes_from_the_environment_and_errors_name_numbers(dist, spec):
    world, rpn = spec
    assert dist.run(world, _env_and_errors, ranks_per_node=rpn) == [rpn] * world


def test_no_process_group_is_a_clear_error():
    assert not tdist.is_initialized()  # the test process itself never joins a group
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group first"):
        Topology()
    with pytest.raises(RuntimeError, match="init_process_group first"):
        all_gather_coalesced([torch.ones(2)])
