"""The ``scheduler`` section: each DeepSpeed schedule's lr trajectory equals DeepSpeed 0.19.8's own class.

Here rather than in zero-full's unit tests: DeepSpeed, the reference, is installed with the
integration tests' peers (on the CPU: ``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from torch.optim.lr_scheduler import LRScheduler  # noqa: E402

from zero_full.config.zero_config import ZeroConfig  # noqa: E402
from zero_full.wiring.schedulers import build_scheduler  # noqa: E402

STEPS = 64

CASES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 7}),
    (
        "WarmupLR",
        {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 13, "warmup_type": "linear"},
    ),
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-4], "warmup_max_lr": [1e-3, 2e-3], "warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 9}),
    (
        "WarmupDecayLR",
        {"total_num_steps": 40, "warmup_max_lr": 5e-4, "warmup_num_steps": 11, "warmup_type": "linear"},
    ),
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 10, "warmup_max_lr": None}),
    ("WarmupCosineLR", {"total_num_steps": 45, "warmup_num_steps": 6}),
    (
        "WarmupCosineLR",
        {"total_num_steps": 30, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05, "warmup_type": "linear"},
    ),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 10}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 2e-3,
            "cycle_first_step_size": 7,
            "cycle_second_step_size": 13,
            "decay_step_size": 3,
            "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.01,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": [1e-3, 3e-3],
            "cycle_first_step_size": 9,
            "cycle_first_stair_count": 3,
            "cycle_second_stair_count": 2,
            "cycle_momentum": False,
        },
    ),
    ("LRRangeTest", {}),
    (
        "LRRangeTest",
        {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.5},
    ),
    (
        "LRRangeTest",
        {"lr_range_test_min_lr": [1e-4, 3e-4], "lr_range_test_step_size": 4, "lr_range_test_staircase": True},
    ),
]


def _optimizer(kind: type[torch.optim.Optimizer] = torch.optim.AdamW) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(7))
    return kind([{"params": [a]}, {"params": [b], "lr": 2e-3}], lr=1e-3)


def _state(optimizer: torch.optim.Optimizer) -> list[tuple]:
    return [(g["lr"], g.get("betas")) for g in optimizer.param_groups]


def _trajectory(scheduler, optimizer: torch.optim.Optimizer, steps: int = STEPS) -> list[list[tuple]]:
    seen = [_state(optimizer)]
    for _ in range(steps):
        scheduler.step()
        seen.append(_state(optimizer))
    return seen


@pytest.mark.parametrize(("kind", "params"), CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_trajectory_equals_deepspeed(kind, params):
    ours_opt, ds_opt = _optimizer(), _optimizer()
    ours = build_scheduler(
        ZeroConfig.model_validate({"scheduler": {"type": kind, "params": params}}), ours_opt
    )
    theirs = getattr(lr_schedules, kind)(ds_opt, **copy.deepcopy(params))
    assert isinstance(ours, LRScheduler)
    assert _trajectory(ours, ours_opt) == _trajectory(theirs, ds_opt)  # exact: same formulas, same order


def test_onecycle_without_betas_keeps_momentum_as_deepspeed():
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}
    ours_opt, ds_opt = _optimizer(torch.optim.SGD), _optimizer(torch.optim.SGD)
    with pytest.warns(UserWarning, match="no betas"):
        ours = build_scheduler(
            ZeroConfig.model_validate({"scheduler": {"type": "OneCycle", "params": params}}), ours_opt
        )
    theirs = lr_schedules.OneCycle(ds_opt, **params)
    assert _trajectory(ours, ours_opt, 20) == _trajectory(theirs, ds_opt, 20)


@pytest.mark.parametrize(("kind", "params"), CASES[1::3], ids=[k for k, _ in CASES[1::3]])
def test_state_dict_round_trip_resumes_the_same_trajectory(kind, params):
    config = ZeroConfig.model_validate({"scheduler": {"type": kind, "params": params}})
    whole_opt = _optimizer()
    whole = _trajectory(build_scheduler(config, whole_opt), whole_opt, 40)

    first_opt = _optimizer()
    first = build_scheduler(config, first_opt)
    head = _trajectory(first, first_opt, 17)
    saved = first.state_dict()
    assert saved == {"last_batch_iteration": 16}

    resumed_opt = _optimizer()  # a fresh optimizer and schedule, as after a restart
    resumed = build_scheduler(config, resumed_opt)
    resumed.load_state_dict(saved)
    assert _state(resumed_opt) == head[-1]
    tail = _trajectory(resumed, resumed_opt, 23)
    assert head + tail[1:] == whole


def test_deepspeed_state_dict_loads_into_ours():
    params = {"total_num_steps": 30, "warmup_num_steps": 5}
    ds_opt, ours_opt = _optimizer(), _optimizer()
    theirs = lr_schedules.WarmupDecayLR(ds_opt, **params)
    for _ in range(12):
        theirs.step()
    ours = build_scheduler(
        ZeroConfig.model_validate({"scheduler": {"type": "WarmupDecayLR", "params": params}}), ours_opt
    )
    ours.load_state_dict(theirs.state_dict())
    assert _trajectory(ours, ours_opt, 10) == _trajectory(theirs, ds_opt, 10)


def test_no_section_builds_nothing_and_missing_params_take_deepspeed_defaults():
    assert build_scheduler(ZeroConfig(), _optimizer()) is None
    cfg = ZeroConfig.model_validate({"scheduler": {"type": "warmuplr"}})
    params = cfg.scheduler.params
    assert (params.warmup_min_lr, params.warmup_max_lr, params.warmup_num_steps) == (0.0, None, 1000)
    assert params.warmup_type.value == "log"


@pytest.mark.parametrize(
    ("scheduler", "culprit"),
    [
        ({"type": "WarmupLinearLR"}, r"scheduler\.type[\s\S]*'WarmupLR'"),
        (
            {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
            r"scheduler\.params\.total_num_steps",
        ),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, r"scheduler\.params\.warmup_num_steps"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, r"scheduler\.params\.warmup_type"),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": -1}}, r"scheduler\.params\.warmup_max_lr"),
        (
            {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
            r"scheduler\.params\.warmup_num_step.*warmup_num_steps",
        ),
        ({"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}, r"scheduler\.params\.cycle_min_lr"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": [1e-4], "cycle_max_lr": 1e-3}}, "cycle_min_lr"),
        ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 2.5}}, "lr_range_test_step_size"),
    ],
)
def test_bad_scheduler_input_names_the_key(scheduler, culprit):
    with pytest.raises(ValidationError, match=culprit):
        ZeroConfig.model_validate({"scheduler": scheduler})


def test_a_list_per_group_of_the_wrong_length_names_the_key():
    cfg = ZeroConfig.model_validate(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 2e-3, 3e-3]}}}
    )
    with pytest.raises(
        ValueError, match=r"scheduler\.params\.warmup_max_lr has 3 values .* 2 parameter groups"
    ):
        build_scheduler(cfg, _optimizer())


def test_a_tensor_learning_rate_is_filled_in_place():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param], lr=torch.tensor(1e-3))
    lr = optimizer.param_groups[0]["lr"]
    cfg = ZeroConfig.model_validate({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}})
    schedule = build_scheduler(cfg, optimizer)
    for _ in range(5):
        schedule.step()
    assert optimizer.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(1e-3, rel=1e-6)
    assert schedule.get_last_lr() == [lr]
