"""Stages 1, 2 and 3 in fp32 / bf16 check inf / nan with the bound their reduce-scatter carries.

The step then issues no collective of its own for the check (counted by ``zero_comm.CommLedger``),
fp16 and MiCS keep the all-reduced flag, and a bound that overflows although no element is
inf / nan is named as such when the step is skipped.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_comm
import zero_full
from zero_testing import captured_logs
from zero_testing.models import TanhMLP


def _net() -> TanhMLP:
    return TanhMLP(11, 13, 3)


def _all_reduces_per_step(rank, stage, precision, mics=False):
    zero = {"stage": stage, **({"mics_shard_size": 2} if mics else {})}
    config = {"zero_optimization": zero, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    engine = zero_full.initialize(_net(), config)
    x = torch.randn(6, 11, generator=torch.Generator().manual_seed(rank.rank)).to(dtype)
    engine.backward(engine(x))
    engine.step()  # the first step: every buffer exists
    with zero_comm.CommLedger(zero_comm.Topology()) as ledger:
        engine.backward(engine(x))
        engine.step()
    engine.close()
    return sum(1 for r in ledger.records if r.op == "all_reduce"), engine.global_steps


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_issues_no_all_reduce_unless_fp16(dist, stage):
    for precision, expected in (("fp32", 0), ("bf16", 0), ("fp16", 1)):
        assert dist.run(2, _all_reduces_per_step, stage, precision) == [(expected, 2)] * 2, precision


def test_mics_keeps_the_flag(dist):
    # shards of 2 at world 4: the replicas' all-reduce, then the flag over the shard group
    assert dist.run(4, _all_reduces_per_step, 3, "fp32", True) == [(2, 2)] * 4


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (self.w * x).sum()  # the gradient of w is x


def _maxima_overflow(rank, stage):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    config = {"zero_optimization": zero, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = zero_full.initialize(Scale(), config)
    x = torch.zeros(4)
    x[rank.rank] = 3.0e38  # each rank's largest gradient at another element: no reduced element overflows
    with captured_logs("zero.engine") as records:
        engine.backward(engine(x))
        engine.step()
    weights = engine.consolidated_state_dict().get("w")  # rank 0 only
    engine.close()
    return engine.stats.skipped_steps, [m for m in records if "non-finite" in m], weights


@pytest.mark.parametrize("stage", [1, 3])
def test_a_bound_overflowing_without_an_inf_element_skips_saying_so(dist, stage):
    results = dist.run(2, _maxima_overflow, stage)
    for r, (skipped, warnings, _) in enumerate(results):
        assert skipped == 1 and len(warnings) == (1 if r == 0 else 0)
    assert torch.equal(results[0][2], torch.ones(4))  # the step was not applied
    message = results[0][1][0]
    assert "no element is inf/nan" in message and "largest |gradient|" in message, message
