"""GradientBound: the inf / nan check carried by the reduce-scatter of stages 1 and 2.

The reference is :func:`zero_optim.found_overflow`, the all-reduce of a flag over the reduced
gradient partitions: on every injected inf / nan / -inf, at every rank, in every micro-step,
the bound read without a collective gives the same answer on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from optim_cases import Odd, batch, make_optimizer

import zero_comm
from zero_optim import GradientBound, ReduceConfig, ReduceScatterInto, found_overflow, replicated_optimizer

# small buckets: several reduce-scatters, each carrying its own sideband
CONFIG = ReduceConfig(reduce_bucket_size=200, overlap_comm=True)


def _inject(param: torch.nn.Parameter, where: int, value: float):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[where] = value
        return grad

    return param.register_hook(hook)


def _checks(rank, stage, bad_rank, value, bad_micro, micros):
    """Both checks after ``micros`` backwards (``bad_rank`` injects ``value`` in micro ``bad_micro``),
    then both again after ``zero_grad`` and one clean backward."""
    model = Odd(unused=True)
    opt, reduction = replicated_optimizer(model, make_optimizer("adamw"), stage, CONFIG)
    bound = opt.partitioning.grad_bound
    target = model.ps[4]  # 1023 elements: split over every rank
    rows = slice(4 * rank.rank, 4 * (rank.rank + 1))
    out = []
    for micro in range(micros):
        handle = _inject(target, 1000, value) if (rank.rank, micro) == (bad_rank, bad_micro) else None
        model(batch(0, micro, rank.world_size)[rows]).backward()  # every backward reduces
        if handle is not None:
            handle.remove()
    reduction.at_boundary()
    out.append((bound.nonfinite(), found_overflow(opt.groups)))
    opt.zero_grad()
    model(batch(1, 0, rank.world_size)[rows]).backward()
    reduction.at_boundary()
    out.append((bound.nonfinite(), found_overflow(opt.groups)))
    reduction.remove()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_the_bound_agrees_with_the_all_reduced_flag_on_every_rank(dist, world, stage):
    """Stage 1 reduces in place, stage 2 stages its buckets; two micro-steps accumulate (or carry)."""
    cases = [(-1, 0.0, 0), (world - 1, float("nan"), 1), (0, float("inf"), 0), (world // 2, -float("inf"), 1)]
    for bad_rank, value, bad_micro in cases:
        results = dist.run(world, _checks, stage, bad_rank, value, bad_micro, 2)
        for (fired, flag), (after_zero, flag_after) in results:
            assert fired == flag == (bad_rank >= 0), (bad_rank, value, fired, flag)
            assert after_zero is flag_after is False  # zero_grad restarts the sum


def _large(rank, stage, same_element):
    model = Odd()
    opt, reduction = replicated_optimizer(model, make_optimizer("sgd"), stage, CONFIG)
    target = model.ps[4]
    # 3e38 on each rank: at one element the reduced sum overflows to inf; at two it stays finite
    handle = _inject(target, 1000 if same_element else 1000 - rank.rank, 3.0e38)
    model(batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
    handle.remove()
    reduction.at_boundary()
    reduction.remove()
    return opt.partitioning.grad_bound.nonfinite(), found_overflow(opt.groups)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_overflowing_sum_is_seen_and_a_sum_of_maxima_overflowing_alone_counts_as_one(dist, stage):
    """The documented difference: the bound is conservative (``sum_r max|g_r| > 3.4e38``)."""
    assert dist.run(2, _large, stage, True) == [(True, True)] * 2
    assert dist.run(2, _large, stage, False) == [(True, False)] * 2


def _which_carry(rank):
    carried = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        opt, reduction = replicated_optimizer(Odd().to(dtype), None, 2, CONFIG, working_dtype=dtype)
        carried.append(opt.partitioning.grad_bound is not None)
        reduction.remove()
    cast = zero_comm.CastReduceScatter(torch.bfloat16, None)
    opt, reduction = replicated_optimizer(Odd(), None, 2, CONFIG, reduce_strategy=cast)
    carried.append(opt.partitioning.grad_bound is not None)
    reduction.remove()
    stage0, _ = replicated_optimizer(Odd(), None, 0, CONFIG)
    carried.append(stage0.partitioning.grad_bound is not None)
    plain, reduction = replicated_optimizer(Odd(), None, 1, CONFIG)
    reduction.remove()
    with pytest.raises(ValueError, match="needs the plain reduce-scatter"):
        ReduceScatterInto(plain.partitioning, cast)
    return carried


def test_only_plain_fp32_and_bf16_reductions_carry_the_bound(dist):
    """fp16, a cast strategy and stage 0 keep the all-reduced flag; a strategy beside a bound is refused."""
    assert dist.run(2, _which_carry) == [[True, True, False, False, False]] * 2


def test_the_sideband_is_the_largest_magnitude_and_propagates_nan():
    bound = GradientBound(3)
    a, b = torch.tensor([1.0, -7.5, 2.0]), torch.tensor([[4.0, 0.5]])
    assert torch.equal(bound.sideband([a, b]), torch.full((3,), 7.5))
    assert torch.equal(bound.sideband([torch.zeros(0)]), torch.zeros(3))
    assert math.isnan(bound.sideband([a, torch.tensor([float("nan")])])[0].item())
    flat = torch.tensor([3.0, -9.0, 1.0, 2.0])
    assert bound.sideband([flat[2:], flat[:2]])[1].item() == 9.0  # regions of one buffer, either order
    assert not bound.nonfinite()  # nothing received yet
    bound.received(torch.tensor([1.0e38], dtype=torch.bfloat16))
    bound.received(torch.tensor([3.0e38]))
    assert bound.nonfinite()  # summed in fp32: 4e38 overflows
    bound.reset()
    bound.received(torch.tensor([2.0]))
    assert not bound.nonfinite()
    with pytest.raises(ValueError, match="needs the bucket's gradients"):
        bound.sideband([])
