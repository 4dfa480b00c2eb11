"""fp16 loss scaling with DeepSpeed's rules, and the one-flag cross-rank overflow check."""

from __future__ import annotations

import math

import pytest
import torch
from optim_cases import Odd, batch, make_optimizer

from zero_optim import FlatGroup, LossScaler, LossScalerConfig, found_overflow, replicated_optimizer


def _deepspeed_reference(cfg: LossScalerConfig, overflows: list[bool]) -> list[float]:
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed (scale factor 2)."""
    scale, hyst, it, last = 2.0**cfg.initial_scale_power, cfg.hysteresis, 0, -1
    out = []
    for overflow in overflows:
        if overflow:
            if cfg.hysteresis == 1 or hyst == 1:
                scale = max(scale / 2, cfg.min_loss_scale)
            else:
                hyst -= 1
            last = it
        else:
            if cfg.consecutive_hysteresis:
                hyst = cfg.hysteresis
            if (it - last) % cfg.loss_scale_window == 0:
                if not cfg.consecutive_hysteresis:
                    hyst = cfg.hysteresis
                scale *= 2
        it += 1
        out.append(scale)
    return out


PATTERN = [False, True, False, True, True, False, False, False, True, True, True, True, False] + [False] * 9


@pytest.mark.parametrize(
    "cfg",
    [
        LossScalerConfig(initial_scale_power=4, loss_scale_window=3, hysteresis=1),
        LossScalerConfig(initial_scale_power=4, loss_scale_window=3, hysteresis=2),
        LossScalerConfig(
            initial_scale_power=3, loss_scale_window=2, hysteresis=2, consecutive_hysteresis=True
        ),
        LossScalerConfig(initial_scale_power=2, loss_scale_window=5, hysteresis=1, min_loss_scale=2.0),
    ],
)
def test_dynamic_scale_follows_deepspeed(cfg):
    scaler = LossScaler(cfg)
    assert scaler.dynamic and scaler.scale == 2.0**cfg.initial_scale_power
    got = []
    for overflow in PATTERN:
        scaler.update(overflow)
        got.append(scaler.scale)
    assert got == _deepspeed_reference(cfg, PATTERN)
    assert scaler.skipped_steps == sum(PATTERN)
    assert min(got) >= cfg.min_loss_scale


def test_first_overflow_halves_with_hysteresis_1_and_waits_with_hysteresis_2():
    one = LossScaler(LossScalerConfig(initial_scale_power=8, hysteresis=1))
    one.update(True)
    assert one.scale == 128.0
    two = LossScaler(LossScalerConfig(initial_scale_power=8, hysteresis=2))
    two.update(True)
    assert two.scale == 256.0
    two.update(True)
    assert two.scale == 128.0


def test_static_scale_never_changes_but_counts_skips():
    scaler = LossScaler(LossScalerConfig(loss_scale=64.0))
    assert not scaler.dynamic
    for overflow in PATTERN:
        scaler.update(overflow)
    assert scaler.scale == 64.0 and scaler.skipped_steps == sum(PATTERN)


def test_state_dict_resumes_exactly():
    cfg = LossScalerConfig(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    a = LossScaler(cfg)
    for overflow in PATTERN[:7]:
        a.update(overflow)
    b = LossScaler(cfg)
    b.load_state_dict(a.state_dict())
    for overflow in PATTERN[7:]:
        a.update(overflow)
        b.update(overflow)
        assert a.scale == b.scale
    assert a.state_dict() == b.state_dict()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="loss_scale must be 0"):
        LossScalerConfig(loss_scale=-1.0)
    with pytest.raises(ValueError, match="hysteresis must be >= 1"):
        LossScalerConfig(hysteresis=0)
    with pytest.raises(ValueError, match="min_loss_scale must be > 0"):
        LossScalerConfig(min_loss_scale=0.0)


def _overflow(rank, bad_rank, value):
    p = torch.nn.Parameter(torch.zeros(7))
    group = FlatGroup([p], ["p"], [7], torch.device("cpu"))
    group.grad.fill_(1.0)
    if rank.rank == bad_rank:
        group.grad[3] = value
    return found_overflow([group])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_an_inf_or_nan_on_one_rank_is_seen_by_every_rank(dist, world):
    assert dist.run(world, _overflow, -1, 0.0) == [False] * world
    assert dist.run(world, _overflow, world - 1, float("inf")) == [True] * world
    assert dist.run(world, _overflow, 0, float("nan")) == [True] * world


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 3.0e38])
@pytest.mark.parametrize("where", [0, 1 << 20, (1 << 20) + 6])
def test_found_overflow_sees_each_non_finite_value_anywhere_without_a_mask(value, where):
    p = torch.nn.Parameter(torch.zeros((1 << 20) + 7))
    group = FlatGroup([p], ["p"], [p.numel()], torch.device("cpu"))
    group.grad.normal_()
    group.grad[where] = value
    with torch.profiler.profile(profile_memory=True) as prof:
        seen = found_overflow([group])
    assert seen == (not math.isfinite(value))
    # one pass without temporaries: no allocation near the gradient's size (isfinite's mask was 1 MB)
    allocated = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert allocated < 1024


def _stage_1_views(rank, bad_rank, value):
    model = Odd(unused=True)
    opt, reduction = replicated_optimizer(model, make_optimizer("adamw"), 1)
    model(batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
    reduction.at_boundary()
    reduction.remove()
    if rank.rank == bad_rank:
        group, seg = list(opt.segments())[-1]
        group.grad_view(seg)[-1] = value
    with torch.profiler.profile() as prof:
        seen = found_overflow(opt.groups)
    ops = [e.name for e in prof.events()]
    views = sum(len(g.grads()) for g in opt.groups)
    return (
        seen,
        ops.count("aten::aminmax") == views,
        ops.count("aten::isfinite"),
        ops.count("aten::_local_scalar_dense"),
    )


@pytest.mark.parametrize("world", [2, 4])
def test_stage_1_in_place_gradients_are_checked_with_one_flag_read(dist, world):
    """Stage 1's gradient partition is one view per parameter: one pass each, one isfinite, one read."""
    for value, bad in ((0.0, -1), (float("nan"), world - 1), (-float("inf"), 0)):
        for seen, one_pass_each, isfinite, reads in dist.run(world, _stage_1_views, bad, value):
            assert seen is (bad >= 0)
            assert one_pass_each and isfinite == 1 and reads == 1
