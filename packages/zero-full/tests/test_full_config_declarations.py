"""Every config key is declared once (stages, condition, status), and what a config reports follows it."""

from __future__ import annotations

import sys
from typing import Annotated

import pytest

from zero_full.config.base import Section, declared_key, key_report
from zero_full.config.reference import config_sections
from zero_full.config.types import ALL_STAGES, Flag, Ignored, Implemented, Key, Refused
from zero_full.config.zero_config import ZeroConfig

# every section class, each once (optimizer.params: Adam / AdamW and SGD)
SECTIONS = list(dict.fromkeys(section.cls for section in config_sections()))


def test_every_field_of_every_section_declares_its_stages_and_status():
    fields = 0
    for cls in SECTIONS:
        for name in cls.model_fields:
            key = declared_key(cls, name)
            assert isinstance(key.status, Implemented | Ignored | Refused), (cls.__name__, name)
            assert key.stages and key.stages <= ALL_STAGES, (cls.__name__, name, key.stages)
            if isinstance(key.status, Ignored | Refused):
                assert key.status.reason.strip(), (cls.__name__, name)
            fields += 1
    assert len(SECTIONS) >= 17 and fields >= 90


def test_a_field_without_a_declaration_is_named():
    class Bare(Section):
        declared: Annotated[Flag, Key(Ignored("for the test"))] = False
        undeclared: Flag = False

    assert declared_key(Bare, "declared").status == Ignored("for the test")
    with pytest.raises(TypeError, match=r"Bare\.undeclared declares 0 Key"):
        key_report(Bare(), stage=0)


# DeepSpeed keys zero accepts without any use for them: (key, a value asking for what zero does not do,
# a stage that would use the key). Each must be reported, not silently accepted.
WITHOUT_EFFECT = [
    ("contiguous_gradients", False, 2),
    ("reduce_scatter", False, 1),
    ("allgather_partitions", False, 2),
    ("round_robin_gradients", True, 1),
    ("stage3_model_persistence_threshold", 1_000_003, 3),
    ("stage3_gather_16bit_weights_on_model_save", True, 3),
    ("stage3_gather_16bit_weights_on_model_save", False, 3),
]


@pytest.mark.parametrize(("key", "value", "stage"), WITHOUT_EFFECT)
def test_keys_without_effect_are_reported_with_their_reason(key, value, stage):
    cfg = ZeroConfig.model_validate({"zero_optimization": {"stage": stage, key: value}})
    assert cfg.ignored_keys() == [f"zero_optimization.{key}"]
    (finding,) = cfg.key_report().ignored
    assert finding.value == value and "used at stage" not in finding.reason and len(finding.reason) > 20
    assert cfg.unsupported_features() == []


@pytest.mark.parametrize(
    ("key", "value", "stage"),
    [
        ("contiguous_gradients", True, 2),
        ("reduce_scatter", True, 1),
        ("allgather_partitions", True, 2),
        ("round_robin_gradients", False, 1),
        ("stage3_model_persistence_threshold", sys.maxsize, 3),
    ],
)
def test_the_value_zero_behaves_as_is_not_reported(key, value, stage):
    cfg = ZeroConfig.model_validate({"zero_optimization": {"stage": stage, key: value}})
    assert cfg.ignored_keys() == []


def test_refused_values_follow_the_declaration_and_the_stage():
    refused = ZeroConfig.model_validate({"zero_optimization": {"stage": 3, "load_from_fp32_weights": False}})
    assert refused.unsupported_features() == [
        "zero_optimization.load_from_fp32_weights = false (master weights from 16-bit copies)"
    ]
    supported = ZeroConfig.model_validate({"zero_optimization": {"stage": 3, "load_from_fp32_weights": True}})
    assert supported.unsupported_features() == [] and supported.ignored_keys() == []
    under_stage_2 = ZeroConfig.model_validate(
        {"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 3}}
    )
    assert under_stage_2.unsupported_features() == []
    (finding,) = under_stage_2.key_report().ignored
    assert finding.reason == "used at stage 3 only; this config is stage 2"


def test_conditions_name_what_the_key_waits_for():
    cfg = ZeroConfig.model_validate(
        {"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4, "auto_cast": True}}
    )
    (finding,) = cfg.key_report().ignored
    assert finding.path == "fp16.hysteresis" and "dynamic loss scaling" in finding.reason
    assert cfg.unsupported_features() == ["fp16.auto_cast = true (casting inputs to fp16)"]
    off = ZeroConfig.model_validate({"fp16": {"auto_cast": True}})  # fp16 off: auto_cast unused, not refused
    assert off.unsupported_features() == [] and off.ignored_keys() == ["fp16.auto_cast"]


def test_an_unused_section_is_reported_once_not_key_by_key():
    cfg = ZeroConfig.model_validate(
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu", "fast_init": True}}}
    )
    assert cfg.ignored_keys() == ["zero_optimization.offload_optimizer"]
