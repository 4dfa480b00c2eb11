"""An optimizer that raises in the middle of ``engine.step()``: the exception reaches the caller as
it was raised, no collective is left in flight, and the next step trains on every rank alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_full
from zero_testing import InjectedFailure, failing_adamw


def _model() -> nn.Module:
    """Odd widths; with a persistence threshold of 8 the biases stay whole at stage 3."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))


def _failing_then_training(rank, stage):
    fail_at = [2]  # the torch optimizer's second range of the first step raises
    zero = {"stage": stage, "sub_group_size": 11, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 8  # the biases stay whole: refreshed in the step
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    engine = zero_full.initialize(_model(), cfg, optimizer=failing_adamw(fail_at))
    torch.manual_seed(rank.rank)
    engine.backward(engine(torch.randn(2, 5)).pow(2).sum())
    with pytest.raises(InjectedFailure):
        engine.step()
    fail_at[0] = 0
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 5)).pow(2).sum())
        engine.step()
    with zero_full.GatheredParameters(list(engine.module.parameters())):
        whole = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    rows = [torch.empty_like(whole) for _ in range(rank.world_size)]
    torch.distributed.all_gather(rows, whole)
    steps = engine.global_steps
    engine.close()
    return steps, all(torch.equal(rows[0], r) for r in rows), bool(whole.isfinite().all())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_optimizer_failure_mid_step_leaves_the_engine_able_to_train(dist, stage):
    for steps, same, finite in dist.run(2, _failing_then_training, stage):
        assert steps == 2  # the failed step is not counted
        assert same and finite
