"""CommLedger records, totals and summary; the ledger-reporting plain collectives."""

from __future__ import annotations

import pytest
import torch
from comm_cases import over_worlds, run_on

from zero_comm import (
    CommLedger,
    CommTotals,
    LinkKind,
    Topology,
    all_gather_coalesced,
    all_reduce,
    all_to_all_single,
    broadcast,
    record,
    reduce_scatter_coalesced,
    ring_wire_bytes,
)


def test_ring_wire_bytes_formulas():
    assert ring_wire_bytes("all_gather", 100, 4) == 300
    assert ring_wire_bytes("reduce_scatter", 400, 4) == 300
    assert ring_wire_bytes("all_to_all", 400, 4) == 300
    assert ring_wire_bytes("all_reduce", 400, 4) == 600
    assert ring_wire_bytes("broadcast", 400, 4) == 300
    assert ring_wire_bytes("all_gather", 100, 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        ring_wire_bytes("gather", 1, 2)


def test_record_without_an_active_ledger_does_nothing():
    record("all_gather", None, payload_bytes=1, wire_bytes=1)  # no process group needed either


def _step_zero(world):
    shards = [torch.ones(n) for n in (7, 0, 131)]
    all_gather_coalesced(shards)
    reduce_scatter_coalesced([torch.ones(5, 3), torch.ones(1)], op="sum")


def _step_one(rank, topo):
    world, me = rank.world_size, rank.rank
    got = {}
    for op, want in (("sum", sum(range(world))), ("avg", sum(range(world)) / world), ("max", world - 1)):
        got[op] = all_reduce(torch.tensor([float(me)] * 3), op=op).tolist() == [want] * 3
    t = torch.arange(6.0) * me
    got["broadcast"] = broadcast(t, src=world - 1).tolist() == (torch.arange(6.0) * (world - 1)).tolist()
    out = torch.empty(world * 2)
    all_to_all_single(out, me * 10 + torch.arange(world * 2.0))
    got["all_to_all"] = out.tolist() == [float(r * 10 + 2 * me + k) for r in range(world) for k in (0, 1)]
    all_gather_coalesced([torch.ones(4)], topo.intra_node_group())  # one rank per node here
    return got


def _ledger_flow(rank):
    world = rank.world_size
    topo = Topology(ranks_per_node=1)  # every rank its own node
    ledger = CommLedger(topo)
    _step_zero(world)
    assert ledger.records == []  # not active yet
    with ledger:
        _step_zero(world)
        assert ledger.step() == 1
        with CommLedger(topo) as inner:
            ok = _step_one(rank, topo)
        with pytest.raises(RuntimeError, match="already active"):
            ledger.__enter__()
    _step_zero(world)  # exited: not recorded
    assert all(ok.values()), ok
    link = LinkKind.INTER_NODE if world > 1 else LinkKind.INTRA_NODE
    assert [r.op for r in ledger.records] == ["all_gather", "reduce_scatter"] + ["all_reduce"] * 3 + [
        "broadcast",
        "all_to_all",
        "all_gather",
    ]
    assert [(r.op, r.wire_bytes, r.step) for r in inner.records] == [
        (r.op, r.wire_bytes, 0) for r in ledger.records[2:]
    ]
    assert ledger.totals(op="all_gather", step=0) == CommTotals(1, 138 * 4, (world - 1) * 138 * 4)
    rs_padded = world * (-(-15 // world) + -(-1 // world)) * 4
    assert ledger.totals(op="reduce_scatter") == CommTotals(1, 16 * 4, (world - 1) * rs_padded // world)
    assert ledger.totals(op="all_reduce").wire_bytes == 3 * (2 * (world - 1) * 12 // world)
    assert ledger.totals(op="broadcast").payload_bytes == (24 if rank.rank == world - 1 else 0)
    local = ledger.select(op="all_gather", step=1)
    assert [(r.link, r.group_ranks, r.wire_bytes) for r in local] == [(LinkKind.INTRA_NODE, (rank.rank,), 0)]
    assert ledger.count(step=1) == 6 and ledger.count(link=link, step=1) == (6 if world == 1 else 5)
    assert ledger.count(link="intra_node") == ledger.count(link=LinkKind.INTRA_NODE)
    summary = ledger.summary()
    rows = [line.split()[:4] for line in summary.splitlines()[3:-2]]
    assert rows == [
        ["0", "all_gather", link.value, "1"],
        ["0", "reduce_scatter", link.value, "1"],
        ["1", "all_gather", "intra_node", "1"],
        ["1", "all_reduce", link.value, "3"],
        ["1", "all_to_all", link.value, "1"],
        ["1", "broadcast", link.value, "1"],
    ], summary
    assert summary.splitlines()[-1].split()[:2] == ["all", "8"]
    return summary


@over_worlds
def test_ledger_records_every_collective_with_its_bytes(dist, spec):
    world, rpn = spec
    summaries = dist.run(world, _ledger_flow, ranks_per_node=rpn)
    assert summaries[0].splitlines()[0] == f"CommLedger: rank 0 of {world} ({world} node(s) x 1)"


def _primitive_errors(rank):
    with pytest.raises(ValueError, match="unsupported reduction 'prod'"):
        all_reduce(torch.ones(2), op="prod")
    with pytest.raises(ValueError, match="op='avg' needs a floating-point dtype"):
        all_reduce(torch.ones(2, dtype=torch.int32), op="avg")
    with pytest.raises(ValueError, match=f"src={rank.world_size} is not a member of the group"):
        broadcast(torch.ones(2), src=rank.world_size)
    with pytest.raises(ValueError, match=r"input \(6,\) and output \(5,\) need equal numel"):
        all_to_all_single(torch.empty(5), torch.empty(6))
    if rank.world_size > 1:
        with pytest.raises(ValueError, match=f"divisible by the group size {rank.world_size}"):
            all_to_all_single(torch.empty(rank.world_size + 1), torch.empty(rank.world_size + 1))
    with pytest.raises(ValueError, match="input 0 is not contiguous"):
        all_reduce(torch.ones(4, 4).t())
    return True


@over_worlds
def test_plain_collective_errors_are_named(dist, spec):
    assert all(run_on(dist, spec, _primitive_errors))
