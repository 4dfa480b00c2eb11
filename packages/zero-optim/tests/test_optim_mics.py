"""MiCS in zero-optim: the two-hop gradient sync and the replica consistency check.

The stage-3 optimizer over a shard-group partition, with gradients reduce-scattered inside
the shard group every micro-step and all-reduced across the replicate group at the
boundary (``ReplicaGradientSync``), must hold exactly this rank's slice of the gradient
plain data parallelism over all N ranks computes (a world all-reduce of the summed
micro-step gradients, divided by N).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from optim_cases import OddParams, micro_step

import zero_params
from zero_comm import CommLedger, Topology, group_ranks
from zero_optim import ReplicaGradientSync, ReplicaMismatchError, check_replicas_consistent, stage3_optimizer


class Odd(OddParams):
    """The odd parameters alone, the loss scaled by the batch's spread."""

    def forward(self, x):
        total = x.new_zeros(())
        for i, p in enumerate(self.ps):
            total = total + ((p * (i + 1) - x.mean()) ** 2).mean() + p.sum() ** 2 * 1e-3 * x.std()
        return total


def _adamw_two_groups(ps):
    return torch.optim.AdamW([{"params": ps[:3], "lr": 1e-2}, {"params": ps[3:]}], lr=3e-3)


def _mics_model(shard: int):
    topo = Topology()
    shard_group, replicate = topo.shard_group(shard), topo.replicate_group(shard)
    model = Odd()
    zero_params.partition(model, shard_group)
    opt, sink = stage3_optimizer(model, _adamw_two_groups)
    return model, opt, sink, ReplicaGradientSync(opt.groups, replicate), replicate


def _batch(micro: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(100 * micro + rank))


def _two_hop_vs_plain_all_reduce(rank, shard: int, accumulate: int) -> dict:
    model, opt, sink, sync, replicate = _mics_model(shard)
    world = dist.get_world_size()
    reference = {n: torch.zeros_like(p) for n, p in Odd().named_parameters()}
    plain = Odd()
    for micro in range(accumulate):
        x = _batch(micro, rank.rank)
        micro_step(model, sink, x)
        plain.zero_grad()
        plain(x).backward()
        for n, p in plain.named_parameters():
            reference[n] += p.grad
    for t in reference.values():  # plain data parallelism over all N ranks
        dist.all_reduce(t)
        t /= world
    with CommLedger(Topology()) as ledger:
        sync.at_boundary()
    worst = 0.0
    for _, seg in opt.segments():
        state = zero_params.state_of(seg.param)
        start, stop = state.shard_range
        expected = reference[seg.name].reshape(-1)[start:stop]
        got = state.grad_partition
        scale = max(expected.abs().max().item(), 1e-12) if expected.numel() else 1.0
        if expected.numel():
            worst = max(worst, (got[: stop - start] - expected).abs().max().item() / scale)
        assert not got[stop - start :].any()  # padding stays zero
    return {
        "worst": worst,
        "calls": [(r.op, r.group_ranks) for r in ledger.records],
        "replicate": group_ranks(replicate),
        "boundaries": sync.boundaries,
    }


@pytest.mark.parametrize(
    "world,per_node,shard,accumulate",
    [(1, 1, 1, 2), (2, 2, 1, 1), (2, 2, 2, 3), (4, 2, 2, 1), (4, 2, 2, 3), (4, 2, 1, 2)],
)
def test_two_hop_sync_equals_a_plain_all_reduce_over_all_ranks(dist, world, per_node, shard, accumulate):
    results = dist.run(world, _two_hop_vs_plain_all_reduce, shard, accumulate, ranks_per_node=per_node)
    for res in results:
        assert res["worst"] <= 1e-6, res["worst"]
        assert res["boundaries"] == 1
        replicas = world // shard
        # one all-reduce over the replicate group for both optimizer groups (concatenated), or none
        assert res["calls"] == ([("all_reduce", tuple(res["replicate"]))] if replicas > 1 else [])


def _check_replicas(rank, shard: int, perturb_rank: int | None) -> str | None:
    model, opt, sink, sync, _ = _mics_model(shard)
    for micro in range(2):
        micro_step(model, sink, _batch(micro, rank.rank))
    sync.at_boundary()
    opt.step()
    opt.zero_grad()
    if rank.rank == perturb_rank:
        group = opt.groups[1]
        seg = next(s for s in group.segments if s.numel)
        opt.torch_optimizer.state[group.master]["exp_avg_sq"][seg.offset] *= 1.5
    try:
        check_replicas_consistent(opt, sync.group)
    except ReplicaMismatchError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("world,shard", [(4, 2), (2, 1), (1, 1)])
def test_replicas_agree_after_training_and_a_perturbed_replica_is_named(dist, world, shard):
    assert (
        dist.run(world, _check_replicas, shard, None, ranks_per_node=2 if world > 1 else 1) == [None] * world
    )
    if world == 1:
        return
    bad = world - 1
    got = dist.run(world, _check_replicas, shard, bad, ranks_per_node=2)
    partners = [r for r in range(world) if r % shard == bad % shard]
    for r, msg in enumerate(got):
        if r in partners:
            assert msg is not None and str(partners) in msg and "'exp_avg_sq'" in msg and "group 1" in msg, (
                msg
            )
            assert "parameter 'ps." in msg
        else:
            assert msg is None
