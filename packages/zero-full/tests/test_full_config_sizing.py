"""Defaults sized from the model: the rule of ``zero_full.config.sizing`` against its formula.

``u = max(L, 2**20)`` with ``L`` the largest parameter's elements; buckets, sub-groups, prefetch
and reuse distance ``min(u, default)``, live parameters ``min(2u, default)``; explicit values win.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero_full
from zero_full.config import ZeroConfig
from zero_full.config.compat import FindingKind
from zero_full.config.prepare import log_config_report, prepare_config

DS_DEFAULTS = {  # DeepSpeed 0.19.8's defaults, in elements
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "sub_group_size": 1_000_000_000,
    "prefetch_bucket_size": 50_000_000,
    "max_reuse_distance": 1_000_000_000,
    "max_live_parameters": 1_000_000_000,
}
STAGE3 = (
    "reduce_bucket_size",
    "sub_group_size",
    "prefetch_bucket_size",
    "max_reuse_distance",
    "max_live_parameters",
)
STAGE12 = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size")


def _formula(largest: int) -> dict[str, int]:
    """The documented rule, written out independently of the implementation."""
    u = max(largest, 2**20)
    return {k: min((2 if k == "max_live_parameters" else 1) * u, cap) for k, cap in DS_DEFAULTS.items()}


def _sizes(config, model, world=2):
    cfg, report = prepare_config(config, model, world)
    z = cfg.zero_optimization
    return cfg, report, {k: getattr(z, k) for k in DS_DEFAULTS}


class _Odd(nn.Module):
    """Odd shapes; the largest parameter is an embedding of 1031 x 1033 (above the floor)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.embed = nn.Embedding(1031, 1033, device=device)
        self.proj = nn.Linear(1033, 977, device=device)
        self.norm = nn.LayerNorm(977, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(self.embed(ids)))


@pytest.mark.parametrize(
    ("model", "largest"),
    [
        (_Odd(), 1031 * 1033),  # above the floor: one largest parameter
        (nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 3)), 13 * 7),  # tiny: the floor
        (nn.Linear(7001, 8009, bias=False, device="meta"), 7001 * 8009),  # > 5e7: prefetch capped
        (nn.Linear(23003, 23011, bias=False, device="meta"), 23003 * 23011),  # > 5e8: buckets capped
    ],
    ids=["odd", "tiny", "large", "huge"],
)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unset_sizes_follow_the_formula(model, largest, stage):
    cfg, report, sizes = _sizes({"zero_optimization": {"stage": stage}}, model)
    used = STAGE3 if stage == 3 else STAGE12 if stage in (1, 2) else ("reduce_bucket_size", "sub_group_size")
    expected = {k: (_formula(largest)[k] if k in used else DS_DEFAULTS[k]) for k in DS_DEFAULTS}
    assert sizes == expected
    sized = {
        f.path.rpartition(".")[2].removeprefix("stage3_"): f.value for f in report.of_kind(FindingKind.SIZED)
    }
    assert sized == {k: expected[k] for k in used}
    assert cfg.ignored_keys() == []  # a key the stage does not use is never set


def test_the_caps_are_deepspeeds_defaults():
    huge = _formula(23003 * 23011)
    assert huge["reduce_bucket_size"] == 500_000_000 and huge["prefetch_bucket_size"] == 50_000_000
    assert huge["sub_group_size"] == 23003 * 23011 and huge["max_live_parameters"] == 1_000_000_000


@pytest.mark.parametrize("spelling", ["stage3_", ""])
def test_explicit_values_win_even_when_equal_to_deepspeeds_defaults(spelling):
    given = {
        "stage": 3,
        "reduce_bucket_size": 500_000_000,  # DeepSpeed's default, given: kept
        "sub_group_size": 17,
        f"{spelling}prefetch_bucket_size": 0,
        f"{spelling}max_live_parameters": 1_000_000_000,
        f"{spelling}max_reuse_distance": 5,
    }
    _, report, sizes = _sizes({"zero_optimization": given}, _Odd())
    assert sizes == {**DS_DEFAULTS, "sub_group_size": 17, "prefetch_bucket_size": 0, "max_reuse_distance": 5}
    assert report.of_kind(FindingKind.SIZED) == []


def test_explicit_and_unset_mix_and_a_zero_config_object_is_sized_too():
    config = ZeroConfig.model_validate({"zero_optimization": {"stage": 3, "reduce_bucket_size": 99}})
    cfg, report, sizes = _sizes(config, _Odd())
    assert sizes == {**_formula(1031 * 1033), "reduce_bucket_size": 99, "allgather_bucket_size": 500_000_000}
    assert config.zero_optimization.sub_group_size == 1_000_000_000  # the object given is not changed
    assert "zero_optimization.reduce_bucket_size" not in {f.path for f in report.findings}


def test_an_auto_value_is_resolved_by_the_hidden_size_rule_not_sized():
    class _HF(_Odd):
        config = type("Config", (), {"hidden_size": 8})()

    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
    }
    _, _, sizes = _sizes(raw, _HF())
    assert (
        sizes["reduce_bucket_size"] == 64
        and sizes["sub_group_size"] == _formula(1031 * 1033)["sub_group_size"]
    )


def test_the_sizes_chosen_are_one_info_line_and_no_warning():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("zero.test_sizing")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_config_report(_sizes({"zero_optimization": {"stage": 3}}, _Odd())[1], logger)
    finally:
        logger.removeHandler(handler)
    assert [r.levelno for r in records] == [logging.INFO]
    text = records[0].getMessage()
    assert "sub_group_size=1065023" in text and "stage3_max_live_parameters=2130046" in text
    assert "1,065,023 elements" in text


def _sized_under_init(rank):
    """Stage 3 under ``zero_full.Init`` (only shards on each rank): sized from the full shapes,
    trains, and takes the same steps as DeepSpeed's defaults given explicitly."""
    losses, sizes = {}, {}
    explicit = {k: DS_DEFAULTS[k] for k in STAGE3}
    for name, zero in (("sized", {"stage": 3}), ("deepspeed", {"stage": 3, **explicit})):
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
        torch.manual_seed(0)
        with zero_full.Init(config=cfg):
            model = _Odd()
        engine = zero_full.initialize(model, cfg, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        torch.manual_seed(1 + rank.rank)
        run = []
        for _ in range(3):
            loss = engine(torch.randint(0, 1031, (2, 5))).pow(2).mean()
            engine.backward(loss)
            engine.step()
            run.append(loss.item())
        losses[name] = run
        z = engine.config.zero_optimization
        sizes[name] = {k: getattr(z, k) for k in STAGE3}
        engine.close()
    return sizes, losses


def test_stage3_under_init_is_sized_from_full_shapes_and_changes_no_number(dist):
    for sizes, losses in dist.run(2, _sized_under_init):
        assert sizes["sized"] == {k: _formula(1031 * 1033)[k] for k in STAGE3}
        assert sizes["deepspeed"] == {k: DS_DEFAULTS[k] for k in STAGE3}
        assert losses["sized"] == losses["deepspeed"]
