"""Strategies over one process group share their fields, repr and checks (zero_comm.strategies.OnGroup)."""

from __future__ import annotations

import pytest
import torch
from comm_cases import over_worlds

from zero_comm import (
    AllGatherStrategy,
    AllToAllReduceScatter,
    CastAllGather,
    CastReduceScatter,
    FlatAllGather,
    GroupPosition,
    HierarchicalAllGather,
    QuantizedAllGather,
    QuantizedReduceScatter,
    ReduceScatterStrategy,
    Topology,
)
from zero_kernels import QuantConfig


def _reprs_and_positions(rank):
    world, me = rank.world_size, rank.rank
    topo = Topology()
    where = f"group_size={world}, group_rank={me}"
    made = {
        FlatAllGather(): f"FlatAllGather({where})",
        AllToAllReduceScatter(): f"AllToAllReduceScatter({where})",
        CastAllGather(torch.bfloat16): f"CastAllGather(dtype=torch.bfloat16, {where})",
        CastReduceScatter(torch.float16): f"CastReduceScatter(dtype=torch.float16, {where})",
        QuantizedAllGather(None, QuantConfig(8, 64)): f"QuantizedAllGather({where}, bits=8, quant_group=64)",
    }
    for strategy, expected in made.items():
        if repr(strategy) != expected:
            raise AssertionError(f"{repr(strategy)!r} != {expected!r}")
    others = [HierarchicalAllGather(topo.hierarchical_groups(world)), QuantizedReduceScatter(topo)]
    positions = [(s.group_size, s.group_rank) for s in [*made, *others]]
    kinds = [
        (isinstance(s, GroupPosition), isinstance(s, AllGatherStrategy), isinstance(s, ReduceScatterStrategy))
        for s in [*made, *others]
    ]
    return positions, kinds


@over_worlds
def test_every_strategy_reports_its_group_position_and_its_repr(dist, spec):
    world, rpn = spec
    got = dist.run(world, _reprs_and_positions, ranks_per_node=rpn)
    gather, reduce = (True, True, False), (True, False, True)
    for r, (positions, kinds) in enumerate(got):
        assert positions == [(world, r)] * 7
        assert kinds == [gather, reduce, gather, reduce, gather, gather, reduce]


def _bad_dtype():
    messages = []
    for cls in (CastAllGather, CastReduceScatter):
        with pytest.raises(ValueError, match="communication dtype must be") as info:
            cls(torch.int32)
        messages.append(str(info.value).split(":")[0])
    return messages


def test_a_casting_strategy_names_itself_for_a_bad_dtype(dist):
    assert dist.run(2, _bad_dtype) == [["CastAllGather", "CastReduceScatter"]] * 2


def test_a_structural_strategy_without_a_group_position_is_not_one():
    class NoPosition:
        def all_gather_coalesced(self, shards, *, async_op=False, out=None): ...

    class WithPosition(NoPosition):
        group_size = 1
        group_rank = 0

    assert not isinstance(NoPosition(), GroupPosition) and not isinstance(NoPosition(), AllGatherStrategy)
    assert isinstance(WithPosition(), GroupPosition) and isinstance(WithPosition(), AllGatherStrategy)
