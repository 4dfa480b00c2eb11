"""Padding arithmetic and the pure rank-partition layouts behind Topology."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero_comm import padded_numel, partition_numel, shard_range
from zero_comm.topology import (
    hierarchical_partitions,
    local_rank_partition,
    node_partition,
    replicate_partition,
    shard_partition,
)


@given(numel=st.integers(0, 10**7), world=st.integers(1, 512))
def test_partitions_cover_the_tensor_exactly_once(numel, world):
    part = partition_numel(numel, world)
    assert padded_numel(numel, world) == world * part
    assert world * part >= numel > world * (part - 1) or numel == part == 0
    covered = 0
    for rank in range(world):
        start, stop = shard_range(numel, world, rank)
        assert start == min(rank * part, numel)
        assert covered == start and start <= stop <= numel
        assert stop - start <= part
        covered = stop
    assert covered == numel


@pytest.mark.parametrize(
    "numel,world,part,ranges",
    [
        (0, 4, 0, [(0, 0)] * 4),
        (1, 4, 1, [(0, 1), (1, 1), (1, 1), (1, 1)]),
        (7, 4, 2, [(0, 2), (2, 4), (4, 6), (6, 7)]),
        (8, 4, 2, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (9, 4, 3, [(0, 3), (3, 6), (6, 9), (9, 9)]),
        (131, 1, 131, [(0, 131)]),
    ],
)
def test_known_partitions(numel, world, part, ranges):
    assert partition_numel(numel, world) == part
    assert [shard_range(numel, world, r) for r in range(world)] == ranges


def test_bad_partition_arguments_are_named():
    with pytest.raises(ValueError, match="world .* must be >= 1, got 0"):
        partition_numel(4, 0)
    with pytest.raises(ValueError, match="numel must be >= 0, got -1"):
        padded_numel(-1, 2)
    with pytest.raises(ValueError, match="rank 4 is outside the group of 4 ranks"):
        shard_range(10, 4, 4)


def _is_partition_of(partition, world):
    flat = sorted(r for group in partition for r in group)
    return flat == list(range(world))


@given(nodes=st.integers(1, 8), rpn=st.integers(1, 8), data=st.data())
def test_group_layouts_partition_the_world(nodes, rpn, data):
    world = nodes * rpn
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    shard = data.draw(st.sampled_from(divisors))
    by_node, by_local = node_partition(world, rpn), local_rank_partition(world, rpn)
    shards, replicas = shard_partition(world, shard), replicate_partition(world, shard)
    for partition in (by_node, by_local, shards, replicas):
        assert _is_partition_of(partition, world)
    assert all(len({r // rpn for r in g}) == 1 for g in by_node)
    assert all(len({r % rpn for r in g}) == 1 and len(g) == nodes for g in by_local)
    assert all(g == tuple(range(g[0], g[0] + shard)) for g in shards)
    assert all(len({r % shard for r in g}) == 1 for g in replicas)
    if shard % rpn and rpn % shard:
        with pytest.raises(ValueError, match=f"shard_size={shard} and ranks_per_node={rpn}"):
            hierarchical_partitions(world, rpn, shard)
        return
    inter, intra = hierarchical_partitions(world, rpn, shard)
    assert _is_partition_of(inter, world) and _is_partition_of(intra, world)
    shard_of = {r: i for i, g in enumerate(shards) for r in g}
    for g in intra:  # one node, one shard group, consecutive
        assert len({r // rpn for r in g}) == 1 and len({shard_of[r] for r in g}) == 1
    for g in inter:  # one local rank, one shard group, every node of that shard group
        assert len({r % rpn for r in g}) == 1 and len({shard_of[r] for r in g}) == 1
        assert len(g) * len(next(i for i in intra if g[0] in i)) == shard


def test_irregular_and_invalid_shard_sizes_are_named():
    with pytest.raises(ValueError, match="shard_size=3 and ranks_per_node=2"):
        hierarchical_partitions(6, 2, 3)
    with pytest.raises(ValueError, match="shard_size=3 does not divide the world size 4"):
        shard_partition(4, 3)
    with pytest.raises(ValueError, match="shard_size must be an integer >= 1, got 0"):
        replicate_partition(4, 0)
