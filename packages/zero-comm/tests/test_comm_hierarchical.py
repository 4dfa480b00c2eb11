"""Hierarchical (2-hop) all-gather and the strategy objects zero-params holds."""

from __future__ import annotations

import torch
from comm_cases import DTYPES, ODD_SIZES, over_worlds, rank_tensor, result_of, same_buffer

from zero_comm import (
    AllGatherStrategy,
    AllToAllReduceScatter,
    CommLedger,
    FlatAllGather,
    HierarchicalAllGather,
    LinkKind,
    ReduceScatterStrategy,
    Topology,
    all_gather_coalesced,
    hierarchical_all_gather_coalesced,
    reduce_scatter_coalesced_padded,
)


def _hierarchical_equals_flat(rank):
    world = rank.world_size
    topo = Topology()  # the pool's ranks_per_node: 2 nodes x 2 ranks at world 4
    hops = topo.hierarchical_groups(world)
    for dtype in DTYPES.values():
        shards = [rank_tensor(i, rank.rank, (n,), dtype) for i, n in enumerate(ODD_SIZES)]
        flat = all_gather_coalesced(shards)
        for async_op in (False, True):
            out = torch.zeros(world * sum(ODD_SIZES), dtype=dtype)
            got = result_of(
                hierarchical_all_gather_coalesced(shards, hops, async_op=async_op, out=out), async_op
            )
            assert all(torch.equal(a, b) for a, b in zip(got, flat)), dtype
            assert same_buffer(got, out.data_ptr())
        (one,) = hierarchical_all_gather_coalesced(shards[-1:], hops)
        assert torch.equal(one, flat[-1])
    return (hops.inter_size, hops.intra_size)


@over_worlds
def test_two_hop_gather_is_bit_exact_with_the_flat_gather(dist, spec):
    world, rpn = spec
    assert dist.run(world, _hierarchical_equals_flat, ranks_per_node=rpn) == [(world // rpn, rpn)] * world


def _degenerate_layouts(rank):
    world = rank.world_size
    shapes = []
    for rpn in (1, world):  # one rank per node / everything on one node
        topo = Topology(ranks_per_node=rpn)
        for shard_size in (1, 2, 4):
            if world % shard_size:
                continue
            hops = topo.hierarchical_groups(shard_size)
            shards = [rank_tensor(i, rank.rank, (n,), torch.float16) for i, n in enumerate((7, 0, 131))]
            ref = all_gather_coalesced(shards, topo.shard_group(shard_size))
            got = hierarchical_all_gather_coalesced(shards, hops)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (rpn, shard_size)
            shapes.append((hops.inter_size, hops.intra_size))
    return shapes


@over_worlds
def test_single_hop_layouts_fall_back_to_a_flat_gather(dist, spec):
    world, rpn = spec
    shard_sizes = [s for s in (1, 2, 4) if world % s == 0]
    expected = [(s, 1) for s in shard_sizes] + [(1, s) for s in shard_sizes]
    assert dist.run(world, _degenerate_layouts, ranks_per_node=rpn) == [expected] * world


def _ledger_of_two_hops(rank):
    world = rank.world_size
    topo = Topology()
    nodes, per_node = topo.num_nodes, topo.ranks_per_node
    shards = [torch.ones(n) for n in (131, 7)]
    shard_bytes = 138 * 4
    with CommLedger(topo) as ledger:
        hierarchical_all_gather_coalesced(shards, topo.hierarchical_groups(world))
    if nodes > 1 and per_node > 1:
        inter, intra = ledger.records
        assert (inter.link, intra.link) == (LinkKind.INTER_NODE, LinkKind.INTRA_NODE)
        assert inter.wire_bytes == (nodes - 1) * shard_bytes
        assert intra.wire_bytes == (per_node - 1) * nodes * shard_bytes
        assert inter.group_ranks == tuple(range(topo.local_rank, world, per_node))
    total = ledger.totals()
    assert total.wire_bytes == (world - 1) * shard_bytes  # same bytes as a flat gather, in two hops
    return total.calls


@over_worlds
def test_ledger_sees_one_inter_node_and_one_intra_node_hop(dist, spec):
    world, rpn = spec
    calls = 2 if world // rpn > 1 and rpn > 1 else 1
    assert dist.run(world, _ledger_of_two_hops, ranks_per_node=rpn) == [calls] * world


def _strategies(rank):
    world = rank.world_size
    topo = Topology()
    flat = FlatAllGather(topo.shard_group(world))
    hier = HierarchicalAllGather(topo.hierarchical_groups(world))
    rs = AllToAllReduceScatter()
    assert isinstance(flat, AllGatherStrategy) and isinstance(hier, AllGatherStrategy)
    assert isinstance(rs, ReduceScatterStrategy) and not isinstance(rs, AllGatherStrategy)
    sizes = [
        (flat.group_size, flat.group_rank),
        (hier.group_size, hier.group_rank),
        (rs.group_size, rs.group_rank),
    ]
    shards = [rank_tensor(i, rank.rank, (n,), torch.bfloat16) for i, n in enumerate((1023, 1))]
    a = flat.all_gather_coalesced(shards).wait()
    b = hier.all_gather_coalesced(shards, async_op=True).wait()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    grads = [rank_tensor(9, rank.rank, (5, 7), torch.float32, integer=True)]
    mine = rs.reduce_scatter_coalesced(grads, op="sum").wait()
    assert torch.equal(mine[0], reduce_scatter_coalesced_padded(grads, op="sum")[0])
    return sizes


@over_worlds
def test_strategies_satisfy_the_protocols(dist, spec):
    world, rpn = spec
    assert dist.run(world, _strategies, ranks_per_node=rpn) == [[(world, r)] * 3 for r in range(world)]
