"""hpZ: secondary shards over the node, gathered without inter-node traffic (2 nodes x 2 ranks)."""

from __future__ import annotations

import torch
from params_cases import reference_partition, run
from torch import nn

import zero_params as zp
from zero_comm import CommLedger, FlatAllGather, LinkKind, Topology

pytest_plugins = ("params_worlds",)


def _hpz():
    topo = Topology()
    secondary = FlatAllGather(topo.intra_node_group())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 3))  # numel 91, 7, 21, 3
    ref = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    states = zp.partition(model, secondary_strategy=secondary)
    before = [s.secondary_valid for s in states]
    with CommLedger(topo) as forward:
        zp.gather(params).wait()  # first (primary) gather of the step builds the secondary shards
    sec_ok = all(
        s.secondary_valid
        and torch.equal(s.secondary_shard, reference_partition(r, topo.ranks_per_node, topo.local_rank))
        for s, r in zip(states, ref)
    )
    zp.release(params)
    with CommLedger(topo) as backward:
        zp.gather(params, secondary=True).wait()
    same = all(torch.equal(p, r) for p, r in zip(params, ref))
    zp.release(params)
    zp.commit_shards(params)  # e.g. after the optimizer step: secondary shards are stale
    after_commit = [s.secondary_valid for s in states]
    with CommLedger(topo) as fallback:
        zp.gather(params, secondary=True).wait()
    same_fallback = all(torch.equal(p, r) for p, r in zip(params, ref))
    zp.release(params)
    inter = LinkKind.INTER_NODE
    return dict(
        nodes=topo.num_nodes,
        before=before,
        sec_ok=sec_ok,
        forward_inter=forward.count(op="all_gather", link=inter),
        backward_calls=backward.count(),
        backward_inter_calls=backward.count(link=inter),
        backward_inter_bytes=backward.totals(link=inter).wire_bytes,
        backward_intra_bytes=backward.totals(link=LinkKind.INTRA_NODE).wire_bytes,
        same=same,
        after_commit=after_commit,
        fallback_inter=fallback.count(op="all_gather", link=inter),
        same_fallback=same_fallback,
    )


def test_secondary_gather_moves_zero_inter_node_bytes(dist, world):
    """At world 4 the pool is 2 nodes x 2 ranks; smaller worlds are one node (values checked)."""
    for r in run(dist, world, _hpz):
        assert r["nodes"] == (2 if world == 4 else 1)
        assert r["before"] == [False] * 4 and r["sec_ok"]
        assert r["backward_calls"] == 1 and r["backward_inter_calls"] == 0
        assert r["backward_inter_bytes"] == 0
        assert r["same"] and r["same_fallback"]
        assert r["after_commit"] == [False] * 4
        if world == 4:
            assert r["forward_inter"] == 1 and r["backward_intra_bytes"] > 0
            assert r["fallback_inter"] == 1  # stale secondary shards: back to the primary group
