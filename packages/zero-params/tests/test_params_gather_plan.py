"""GatherPlan: a fixed list of parameters gathered again and again, planned once, against the values."""

from __future__ import annotations

import torch
import torch.distributed as dist
from params_cases import run
from torch import nn

import zero_params as zp
from zero_comm import CommLedger, Topology

pytest_plugins = ("params_worlds",)

# Odd shapes: a prime, one element, a vector below a power of two, a matrix of odd sides.
SHAPES = [(13,), (1,), (1023,), (7, 31), (5, 3)]


def _params(threshold: int = 0) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]
    full = [p.detach().clone() for p in params]
    zp.partition([(f"p{i}", p) for i, p in enumerate(params)], persistence_threshold=threshold)
    return params, full


def _matches(params: list[nn.Parameter], full: list[torch.Tensor]) -> bool:
    return all(type(p) is nn.Parameter and torch.equal(p, f) for p, f in zip(params, full))


def _step(params: list[nn.Parameter], full: list[torch.Tensor], turn: int) -> None:
    """What an optimizer step does to the shards: new values in place (same tensors)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for p, f in zip(params, full):
        state = zp.state_of(p)
        f.add_(turn)
        start, stop = state.shard_range
        state.shard[: stop - start].copy_(f.reshape(-1)[start:stop])
        assert state.partition_numel == -(-f.numel() // world) and state.group_rank == rank


def _planned_gathers():
    params, full = _params()
    plan = zp.GatherPlan(params)
    saved = params[3]  # autograd's saved view of a gathered weight must see each refill
    results = []
    with CommLedger(Topology()) as ledger:
        for turn in range(3):
            _step(params, full, turn)
            handle = plan.issue()
            inflight = all(zp.state_of(p).status is zp.ParamStatus.INFLIGHT for p in params)
            handle.wait()
            if turn == 0:
                view = saved.detach()
            results.append((inflight, _matches(params, full), torch.equal(view, full[3])))
            zp.release(params)
            assert all(zp.state_of(p).unsharded.nbytes == 0 for p in params)
    return results, ledger.count(op="all_gather"), "planned=True" in repr(plan)


def test_a_plan_gathers_the_current_values_with_one_collective_each_time(dist, world):
    for results, count, planned in run(dist, world, _planned_gathers):
        assert results == [(True, True, True)] * 3
        assert count == 3 and planned


def _changed_under_the_plan():
    params, full = _params()
    plan = zp.GatherPlan(params)
    plan.issue().wait()
    zp.release(params)
    checks = []
    # a shard rebound to another buffer (an optimizer's flat buffer): planned again
    flat = torch.zeros(sum(zp.state_of(p).partition_numel for p in params))
    offset = 0
    for p in params:
        n = zp.state_of(p).partition_numel
        zp.state_of(p).bind_shard(flat[offset : offset + n])
        offset += n
    _step(params, full, 1)
    plan.issue().wait()
    checks.append(_matches(params, full))
    zp.release(params)
    # one parameter already gathered by other means: that call is gather()'s, which skips it
    zp.gather(params[1:2]).wait()
    plan.issue().wait()
    checks.append(_matches(params, full))
    zp.release(params)
    # and planned again afterwards
    _step(params, full, 2)
    plan.issue().wait()
    checks.append(_matches(params, full) and "planned=True" in repr(plan))
    zp.release(params)
    return checks


def test_a_plan_follows_rebound_shards_and_parameters_gathered_elsewhere(dist, world):
    for checks in run(dist, world, _changed_under_the_plan):
        assert checks == [True, True, True]


def _unplannable():
    params, full = _params(threshold=13)  # (13,), (1,) and (5, 3) stay whole: persistent
    plan = zp.GatherPlan(params)
    matched = []
    for _ in range(2):
        plan.issue().wait()
        matched.append(_matches(params, full))
        zp.release(params)
    return matched, "planned=False" in repr(plan)


def test_a_plan_with_persistent_parameters_takes_the_gather_path(dist, world):
    for matched, unplanned in run(dist, world, _unplannable):
        assert matched == [True, True] and unplanned
