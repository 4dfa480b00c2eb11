"""Stages 0, 1 and 2 on the partitioned-optimizer core: whole parameters, partitioned fp32 state.

Each rank trains on its slice of the batch with ``replicated_optimizer``; after every
step all ranks hold the same whole parameters, equal to a torch optimizer stepping the
whole model on the whole batch in one process. The flat layout (per-parameter partitions,
padding to the world size) is the stage-3 one, so state dicts are stage-independent.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_comm
import zero_params
from zero_optim import (
    BoundaryReduction,
    HookedReduction,
    ReduceConfig,
    ReplicaPartitioning,
    replicated_optimizer,
    stage3_optimizer,
)
from zero_testing import assert_state_close

SHAPES = [(0,), (1,), (7,), (3, 5), (1023,), (13, 11), (2,)]


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in SHAPES)
        self.inner = nn.Linear(5, 3)
        self.unused = nn.Linear(2, 2)  # never gets a gradient: reduced as zeros

    def forward(self, x):
        total = self.inner(x[:, :5]).pow(2).mean()
        for i, p in enumerate(self.ps):
            total = total + ((p * (i + 1) - x.mean()) ** 2).mean() + p.sum() ** 2 * 1e-3
        return total


def _batch(step, micro, world):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(4 * world, 6, generator=g)


def _make(kind):
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    return lambda ps: torch.optim.AdamW(
        [{"params": ps[:4], "lr": 1e-2}, {"params": ps[4:], "weight_decay": 0.1}], lr=3e-3
    )


def _train(rank, stage, kind, steps, accumulate, bucket, overlap):
    model = Odd()
    cfg = ReduceConfig(reduce_bucket_size=bucket, overlap_comm=overlap)
    opt, reduction = replicated_optimizer(
        model, _make(kind), stage, cfg, allgather_bucket_size=bucket, sub_group_size=max(bucket // 7, 1)
    )
    world, r = rank.world_size, rank.rank
    for step in range(steps):
        for micro in range(accumulate):
            x = _batch(step, micro, world)
            (model(x[4 * r : 4 * (r + 1)]) / accumulate).backward()
            if stage == 2:  # gradients were reduced during backward and freed
                assert all(p.grad is None for p in model.parameters())
        reduction.at_boundary()
        if stage != 1:  # stage 1 (fp32) keeps .grad bound to its flat buffer, reduced in place
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    reduction.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(kind, steps, accumulate, world):
    model = Odd()
    opt = _make(kind)(list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for step in range(steps):
        for micro in range(accumulate):
            x = _batch(step, micro, world)
            (sum(model(x[4 * r : 4 * (r + 1)]) for r in range(world)) / world / accumulate).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {n: p.detach() for n, p in model.named_parameters()}


CASES = [
    (1, 1, "sgd", 1, 10**6, False),
    (2, 0, "sgd", 2, 300, False),
    (2, 1, "sgd", 2, 300, False),
    (2, 2, "sgd", 3, 300, True),
    (2, 2, "adamw", 1, 10**6, False),
    (4, 0, "adamw", 2, 64, False),
    (4, 1, "adamw", 1, 64, False),
    (4, 2, "sgd", 2, 64, False),
]


@pytest.mark.parametrize("world,stage,kind,accumulate,bucket,overlap", CASES)
def test_stages_0_1_2_train_like_the_torch_optimizer_on_the_whole_batch(
    dist, world, stage, kind, accumulate, bucket, overlap
):
    results = dist.run(world, _train, stage, kind, 3, accumulate, bucket, overlap)
    ref = _reference(kind, 3, accumulate, world)
    rel = 1e-6 if kind == "sgd" else 1e-5
    for r, full in enumerate(results):
        assert_state_close(full, ref, rel=rel)
        for n, p in full.items():
            assert torch.equal(p, results[0][n]), f"rank {r} holds another {n} than rank 0"


def _layout(rank, stage):
    model = Odd()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, reduction = replicated_optimizer(model, _make("adamw"), stage)
    world = 1 if stage == 0 else rank.world_size
    r = 0 if stage == 0 else rank.rank
    for group, seg in opt.segments():
        part = zero_comm.partition_numel(seg.param.numel(), world)
        assert seg.numel == part
        flat = values[seg.name].reshape(-1)
        start = min(r * part, flat.numel())
        stop = min(start + part, flat.numel())
        assert torch.equal(group.master_view(seg)[: stop - start], flat[start:stop])
        assert not group.master_view(seg)[stop - start :].any()
        assert seg.param.shape == values[seg.name].shape  # parameters stay whole
    kind = HookedReduction if stage == 2 else BoundaryReduction
    assert isinstance(reduction, kind)
    reduction.remove()
    return opt.state_dict()["layout"]


def _stage3_layout(rank):
    model = Odd()
    zero_params.partition(model)
    opt, _ = stage3_optimizer(model, _make("adamw"))
    return opt.state_dict()["layout"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_flat_layout_and_state_dict_layout_are_those_of_stage_3(dist, world):
    s1 = dist.run(world, _layout, 1)
    s2 = dist.run(world, _layout, 2)
    s3 = dist.run(world, _stage3_layout)
    assert s1 == s2 == s3
    s0 = dist.run(world, _layout, 0)
    assert s0 == dist.run(1, _stage3_layout) * world  # stage 0: a one-rank partition world


def _state_dict_round_trip(rank, stage):
    model = Odd()
    opt, reduction = replicated_optimizer(model, _make("adamw"), stage)
    x = _batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]
    model(x).backward()
    reduction.at_boundary()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = Odd()
    opt2, red2 = replicated_optimizer(fresh, _make("adamw"), 3 - stage)  # stage 1 <-> stage 2
    opt2.load_state_dict(saved)  # all-gathers the loaded partitions into the whole parameters
    reduction.remove()
    red2.remove()
    return all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters())


@pytest.mark.parametrize("stage", [1, 2])
def test_a_stage_1_state_dict_loads_into_stage_2_and_back(dist, stage):
    assert dist.run(2, _state_dict_round_trip, stage) == [True, True]


def _bf16(rank, stage):
    model = Odd().to(torch.bfloat16)
    opt, reduction = replicated_optimizer(model, _make("sgd"), stage, working_dtype=torch.bfloat16)
    x = _batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)].to(torch.bfloat16)
    model(x).backward()
    reduction.at_boundary()
    assert all(g.grad.dtype == torch.float32 and g.master.dtype == torch.float32 for g in opt.groups)
    assert any(g.grad.any() for g in opt.groups)
    opt.step()
    reduction.remove()
    part = opt.partitioning
    for group, seg in opt.segments():
        assert seg.param.dtype == torch.bfloat16
        n = seg.param.numel()
        start = min(part.rank * seg.numel, n)
        stop = min(start + seg.numel, n)
        # the whole bf16 parameter holds the updated fp32 master, rounded, at this rank's partition
        expected = group.master_view(seg)[: stop - start].to(torch.bfloat16)
        assert torch.equal(seg.param.detach().reshape(-1)[start:stop], expected)
    return True


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_parameters_follow_the_fp32_master(dist, stage):
    assert dist.run(2, _bf16, stage) == [True, True]


def _hooks_removed(rank):
    model = Odd()
    _, reduction = replicated_optimizer(model, _make("sgd"), 2)
    reduction.remove()
    model(_batch(0, 0, 1)).backward()
    return all(p.grad is not None for p in model.ps)  # no hook took the gradients away


def test_stage_2_hooks_are_removable(dist):
    assert dist.run(2, _hooks_removed) == [True, True]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="stages 0, 1 and 2"):
        replicated_optimizer(Odd(), None, 3)
    with pytest.raises(ValueError, match=r"'ps.0' is torch.float64, but training runs in torch.float32"):
        replicated_optimizer(Odd().double(), None, 1)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        ReplicaPartitioning(2, 2)


def _grads_held_until_their_bucket(rank):
    model = Odd()
    # one bucket for the whole model: before staging, every gradient waited in .grad for the last one
    _, reduction = replicated_optimizer(model, _make("sgd"), 2, ReduceConfig(reduce_bucket_size=10**6))
    held = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: held.append(n) if p.grad is not None else None)
    model(_batch(0, 0, rank.world_size)).backward()
    reduction.remove()
    return held


@pytest.mark.parametrize("world", [2, 4])
def test_stage_2_stages_each_gradient_on_arrival_and_frees_it(dist, world):
    """Contiguous gradients: a bucket holds one staging buffer, not its parameters' whole gradients."""
    assert dist.run(world, _grads_held_until_their_bucket) == [[]] * world
