"""zero_comm.GradientBound in the optimizers: the inf / nan check carried by the reduce-scatter.

The reference is :func:`zero_optim.found_overflow`, the all-reduce of a flag over the reduced
gradient partitions: on every injected inf / nan / -inf, at every rank, in every micro-step,
the bound read without a collective gives the same answer on every rank.
"""

from __future__ import annotations

import pytest
import torch
from optim_cases import Odd, batch, make_optimizer, micro_step

import zero_comm
import zero_params
from zero_optim import ReduceConfig, ReduceScatterInto, found_overflow, replicated_optimizer, stage3_optimizer

# small buckets: several reduce-scatters, each carrying its own sideband
CONFIG = ReduceConfig(reduce_bucket_size=200, overlap_comm=True)


def _inject(param: torch.nn.Parameter, where: int, value: float):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[where] = value
        return grad

    return param.register_hook(hook)


class _Stage:
    """Stage 1 or 2 (``replicated_optimizer``), or 3 (``stage3_optimizer`` over ``zero_params`` shards)."""

    def __init__(self, stage, model):
        self.model = model
        if stage == 3:
            zero_params.partition(model)
            self.opt, self.sink = stage3_optimizer(model, make_optimizer("adamw"), CONFIG, bound_grads=True)
            self.reduction = None
        else:
            self.opt, self.reduction = replicated_optimizer(model, make_optimizer("adamw"), stage, CONFIG)

    def backward(self, x):
        if self.reduction is None:
            micro_step(self.model, self.sink, x)
        else:
            self.model(x).backward()  # every backward reduces

    def checks(self):
        if self.reduction is not None:
            self.reduction.at_boundary()
        return self.opt.partitioning.grad_bound.nonfinite(), found_overflow(self.opt.groups)


def _checks(rank, stage, bad_rank, value, bad_micro, micros):
    """Both checks after ``micros`` backwards (``bad_rank`` injects ``value`` in micro ``bad_micro``),
    then both again after ``zero_grad`` and one clean backward."""
    run = _Stage(stage, Odd(unused=stage != 3))
    target = run.model.ps[4]  # 1023 elements: split over every rank
    rows = slice(4 * rank.rank, 4 * (rank.rank + 1))
    out = []
    for micro in range(micros):
        handle = _inject(target, 1000, value) if (rank.rank, micro) == (bad_rank, bad_micro) else None
        run.backward(batch(0, micro, rank.world_size)[rows])
        if handle is not None:
            handle.remove()
    out.append(run.checks())
    run.opt.zero_grad()
    run.backward(batch(1, 0, rank.world_size)[rows])
    out.append(run.checks())
    if run.reduction is not None:
        run.reduction.remove()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_bound_agrees_with_the_all_reduced_flag_on_every_rank(dist, world, stage):
    """Stage 1 reduces in place, stage 2 stages its buckets, stage 3 reduces shards' gradients
    (``zero_params.reduce_scatter_grads``); two micro-steps accumulate (or carry)."""
    cases = [(-1, 0.0, 0), (world - 1, float("nan"), 1), (0, float("inf"), 0), (world // 2, -float("inf"), 1)]
    for bad_rank, value, bad_micro in cases:
        results = dist.run(world, _checks, stage, bad_rank, value, bad_micro, 2)
        for (fired, flag), (after_zero, flag_after) in results:
            assert fired == flag == (bad_rank >= 0), (bad_rank, value, fired, flag)
            assert after_zero is flag_after is False  # zero_grad restarts the sum


def _large(rank, stage, same_element):
    run = _Stage(stage, Odd())
    # 3e38 on each rank: at one element the reduced sum overflows to inf; at two it stays finite
    handle = _inject(run.model.ps[4], 1000 if same_element else 1000 - rank.rank, 3.0e38)
    run.backward(batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)])
    handle.remove()
    found = run.checks()
    if run.reduction is not None:
        run.reduction.remove()
    return found


@pytest.mark.parametrize("stage", [1, 2, 3])
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


def _stage3_refusals(rank):
    messages = []
    half = Odd().half()
    zero_params.partition(half)
    cast = Odd()
    zero_params.partition(cast, reduce_strategy=zero_comm.CastReduceScatter(torch.bfloat16, None))
    for model, dtype in ((half, torch.float16), (cast, torch.float32)):
        try:
            stage3_optimizer(model, None, CONFIG, working_dtype=dtype, bound_grads=True)
        except ValueError as exc:
            messages.append(str(exc))
    groups = [torch.distributed.new_group([r]) for r in range(rank.world_size)]
    alone = Odd()  # each rank its own shard group, as MiCS's shard groups are fewer than the world
    zero_params.partition(alone, groups[rank.rank])
    try:
        stage3_optimizer(alone, None, CONFIG, bound_grads=True)
    except ValueError as exc:
        messages.append(str(exc))
    plain = Odd()
    zero_params.partition(plain)
    opt, sink = stage3_optimizer(plain, None, CONFIG)  # no bound asked: none carried
    messages.append(opt.partitioning.grad_bound is None)
    try:  # a bound over another number of ranks than the reduce-scatter's
        zero_params.reduce_scatter_grads(list(plain.parameters()), bound=zero_comm.GradientBound(3))
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_only_plain_fp32_and_bf16_reductions_carry_the_bound(dist):
    """fp16, a cast strategy and stage 0 keep the all-reduced flag; a strategy beside a bound is refused."""
    assert dist.run(2, _which_carry) == [[True, True, False, False, False]] * 2
    half, cast, alone, unbound, other_world = dist.run(2, _stage3_refusals)[0]
    assert "needs fp32 or bf16 gradients" in half
    assert "'inner.bias' is reduced by CastReduceScatter" in cast and "plain AllToAllReduceScatter" in cast
    assert "reduced over 1 of 2 ranks" in alone and "MiCS" in alone
    assert unbound is True
    assert "over 2 ranks" in other_world and "AllToAllReduceScatter over 3" in other_world
