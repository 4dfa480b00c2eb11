"""ZeroConfig: DeepSpeed-style configs, spellings, error messages, derived values."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from pydantic import ValidationError

from zero_full.config.zero_config import (
    BatchSizes,
    ConfigFileError,
    OffloadDevice,
    OptimizerType,
    Precision,
    ZeroConfig,
    ZeroOptimizationConfig,
)
from zero_full.wiring.optimizers import build_optimizer

# What a user brings from a DeepSpeed / HF-Trainer setup (with "auto" values resolved).
REALISTIC = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "initial_scale_power": 12,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 4.5e7,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def errors_of(data: dict, cls: type = ZeroConfig) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(data)
    return info.value.errors()


def error_text(data: dict, cls: type = ZeroConfig) -> str:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(data)
    return str(info.value)


def zero_opt(**knobs: object) -> dict:
    return {"zero_optimization": knobs}


# ----------------------------------------------------------------------------- realistic config


def test_realistic_deepspeed_config_maps_to_typed_values() -> None:
    cfg = ZeroConfig.model_validate(REALISTIC)
    z = cfg.zero_optimization
    assert cfg.precision is Precision.FP16
    assert cfg.stage == 3
    assert (z.prefetch_bucket_size, z.param_persistence_threshold) == (45_000_000, 10_000)
    assert (z.max_live_parameters, z.max_reuse_distance) == (1_000_000_000, 1_000_000_000)
    assert type(z.reduce_bucket_size) is int and z.reduce_bucket_size == 500_000_000
    assert z.gather_16bit_weights_on_model_save is True
    assert z.model_persistence_threshold == sys.maxsize  # DeepSpeed default
    assert z.offload_optimizer.device is OffloadDevice.NONE and not z.offload_param.enabled
    assert cfg.fp16.dynamic_loss_scale and cfg.fp16.initial_scale == 4096.0
    assert (cfg.fp16.loss_scale_window, cfg.fp16.hysteresis, cfg.fp16.min_loss_scale) == (500, 2, 1.0)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 100
    opt = cfg.optimizer
    assert opt is not None and opt.type is OptimizerType.ADAMW
    assert opt.params.betas == (0.9, 0.95) and opt.params.weight_decay == 0.1 and opt.params.lr == 3e-4
    assert cfg.resolve_batch(world_size=2) == BatchSizes(64, 4, 8, 2)
    assert cfg.unsupported_features() == []
    # zero has no save_16bit_model
    assert cfg.ignored_keys() == ["zero_optimization.stage3_gather_16bit_weights_on_model_save"]


def test_realistic_config_from_json_file(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(REALISTIC, indent=2))
    assert ZeroConfig.from_json(path) == ZeroConfig.model_validate(REALISTIC)
    assert ZeroConfig.coerce(str(path)) == ZeroConfig.coerce(REALISTIC)


def test_defaults_follow_deepspeed() -> None:
    cfg = ZeroConfig()
    z = cfg.zero_optimization
    assert cfg.precision is Precision.FP32 and cfg.stage == 0 and cfg.optimizer is None
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.prefetch_bucket_size) == (
        500_000_000,
        500_000_000,
        50_000_000,
    )
    assert (z.param_persistence_threshold, z.zero_hpz_partition_size, z.mics_shard_size) == (100_000, 1, -1)
    assert (z.offload_param.buffer_count, z.offload_param.buffer_size, z.offload_param.max_in_cpu) == (
        5,
        100_000_000,
        1_000_000_000,
    )
    assert (z.offload_optimizer.buffer_count, z.offload_optimizer.ratio) == (4, 1.0)
    assert (cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window, cfg.fp16.hysteresis) == (16, 1000, 2)
    assert cfg.fp16.consecutive_hysteresis is False and cfg.fp16.min_loss_scale == 1.0
    assert cfg.gradient_clipping == 0.0
    assert ZeroConfig.coerce(None) == cfg


@pytest.mark.parametrize(("stage", "expected"), [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_defaults_to_true_for_stage_3_only(stage: int, expected: bool) -> None:
    assert ZeroConfig.model_validate(zero_opt(stage=stage)).zero_optimization.overlap_comm is expected
    explicit = ZeroConfig.model_validate(zero_opt(stage=stage, overlap_comm=not expected))
    assert explicit.zero_optimization.overlap_comm is (not expected)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_is_reported_as_ignored_where_the_stage_always_or_never_overlaps(stage: int) -> None:
    """Stage 1 always reduces during backward, stage 0 after it: only stages 2 and 3 use the key."""
    assert ZeroConfig.model_validate(zero_opt(stage=stage)).ignored_keys() == []
    for value in (True, False):
        given = ZeroConfig.model_validate(zero_opt(stage=stage, overlap_comm=value))
        expected = ["zero_optimization.overlap_comm"] if stage < 2 else []
        assert given.ignored_keys() == expected, (stage, value)


@pytest.mark.parametrize(
    ("stage", "overlap", "used"),
    [(0, None, True), (1, None, True), (2, None, False), (2, True, True), (3, None, True), (3, False, False)],
)
def test_reduce_max_inflight_reaches_the_reductions_or_is_reported_as_ignored(
    stage: int, overlap: bool | None, used: bool
) -> None:
    """Used wherever reductions run asynchronously: stages 0 and 1, stages 2 and 3 with overlap_comm."""
    default = ZeroConfig.model_validate(zero_opt(stage=stage)).zero_optimization
    assert default.to_reduce_config().max_inflight == 1
    extra = {} if overlap is None else {"overlap_comm": overlap}
    given = ZeroConfig.model_validate(zero_opt(stage=stage, reduce_max_inflight=3, **extra))
    assert given.zero_optimization.to_reduce_config().max_inflight == 3
    assert given.ignored_keys() == ([] if used else ["zero_optimization.reduce_max_inflight"])


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_reduce_max_inflight_must_be_a_whole_number_of_at_least_one(value: object) -> None:
    with pytest.raises(ValidationError, match="reduce_max_inflight"):
        ZeroConfig.model_validate(zero_opt(stage=1, reduce_max_inflight=value))


def test_precision_enum_and_bfloat16_alias() -> None:
    assert ZeroConfig.model_validate({"bf16": {"enabled": True}}).precision is Precision.BF16
    assert ZeroConfig.model_validate({"bfloat16": {"enabled": True}}).precision is Precision.BF16
    assert (
        ZeroConfig.model_validate({"fp16": {"enabled": False}, "bf16": {"enabled": False}}).precision
        is Precision.FP32
    )
    text = error_text({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled are both true" in text


def test_static_loss_scale() -> None:
    cfg = ZeroConfig.model_validate({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 20}})
    assert not cfg.fp16.dynamic_loss_scale and cfg.fp16.initial_scale == 128.0
    assert cfg.ignored_keys() == ["fp16.initial_scale_power"]


def test_config_is_frozen_and_round_trips() -> None:
    cfg = ZeroConfig.model_validate(REALISTIC)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.zero_optimization.stage = 1  # type: ignore[misc]
    assert ZeroConfig.model_validate(cfg.model_dump()) == cfg
    assert ZeroConfig.coerce(cfg) is cfg


# ----------------------------------------------------------------------------- optimizer


def test_adamw_weight_decay_defaults_to_deepspeed_zero() -> None:
    cfg = ZeroConfig.model_validate({"optimizer": {"type": "adamw", "params": {"lr": 1e-3}}})
    assert cfg.optimizer.type is OptimizerType.ADAMW
    assert cfg.optimizer.params.weight_decay == 0.0  # DeepSpeed's default, not torch's 0.01
    opt = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(3))])
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.0 and group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999)


def test_optimizer_without_params_uses_defaults() -> None:
    cfg = ZeroConfig.model_validate({"optimizer": {"type": "ADAM"}})
    assert cfg.optimizer.params.lr == 1e-3 and cfg.optimizer.params.eps == 1e-8


@pytest.mark.parametrize(
    ("type_", "extra", "expected_cls"),
    [
        ("Adam", {}, torch.optim.AdamW),  # DeepSpeed: Adam means decoupled decay unless adam_w_mode=false
        ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
        ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),
        ("sgd", {"momentum": 0.9, "nesterov": True}, torch.optim.SGD),
    ],
)
def test_optimizer_build_follows_deepspeed_rules(type_: str, extra: dict, expected_cls: type) -> None:
    cfg = ZeroConfig.model_validate(
        {"optimizer": {"type": type_, "params": {"lr": 0.5, "weight_decay": 0.01, **extra}}}
    )
    params = [torch.nn.Parameter(torch.ones(7))]
    opt = build_optimizer(cfg.optimizer, params)
    assert type(opt) is expected_cls
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.01
    if type_ == "sgd":
        assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["nesterov"] is True


def test_adam_step_matches_torch_reference() -> None:
    cfg = ZeroConfig.model_validate(
        {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.5}}}
    )
    ours = torch.nn.Parameter(torch.arange(7.0))
    ref = torch.nn.Parameter(torch.arange(7.0))
    opt = build_optimizer(cfg.optimizer, [ours])
    ref_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.5)
    for p, o in ((ours, opt), (ref, ref_opt)):
        p.grad = torch.linspace(-1, 1, 7)
        o.step()
    assert torch.equal(ours.detach(), ref.detach())


def test_optimizer_params_checked_per_type() -> None:
    errs = errors_of({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}})
    assert errs[0]["loc"] == ("optimizer", "params", "betas")
    assert "did you mean" not in errs[0]["msg"] and "momentum" in errs[0]["msg"]  # lists SGD's keys
    text = error_text({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}})
    assert "nesterov = true needs momentum > 0" in text
    text = error_text({"optimizer": {"type": "Adamm"}})
    assert "optimizer.type" in text and "'Adam', 'AdamW', 'SGD'" in text and "did you mean 'Adam'" in text
    text = error_text({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})
    assert "optimizer.params.max_grad_norm" in text and "gradient_clipping" in text


def test_bias_correction_false_is_unsupported() -> None:
    cfg = ZeroConfig.model_validate({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})
    assert cfg.unsupported_features() == [
        "optimizer.params.bias_correction = false (Adam without bias correction)"
    ]
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])


# ----------------------------------------------------------------------------- spellings


STAGE3_KNOBS = [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 12_345),
    ("param_persistence_threshold", "stage3_param_persistence_threshold", 17),
    ("model_persistence_threshold", "stage3_model_persistence_threshold", 1_000_003),
    ("max_live_parameters", "stage3_max_live_parameters", 1_023),
    ("max_reuse_distance", "stage3_max_reuse_distance", 7),
    ("module_granularity_threshold", "stage3_module_granularity_threshold", 5_000),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
    ("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save", True),
]


@pytest.mark.parametrize(("short", "long", "value"), STAGE3_KNOBS)
def test_both_spellings_give_the_same_setting(short: str, long: str, value: object) -> None:
    by_long = ZeroConfig.model_validate(zero_opt(stage=3, **{long: value}))
    by_short = ZeroConfig.model_validate(zero_opt(stage=3, **{short: value}))
    both = ZeroConfig.model_validate(zero_opt(stage=3, **{short: value, long: value}))
    assert getattr(by_long.zero_optimization, short) == value
    assert by_long == by_short == both
    assert getattr(ZeroConfig().zero_optimization, short) != value  # the test value is not the default


@pytest.mark.parametrize(("short", "long", "value"), STAGE3_KNOBS)
def test_both_spellings_with_different_values_conflict(short: str, long: str, value: object) -> None:
    other = (not value) if isinstance(value, bool) else value + 1
    errs = errors_of(zero_opt(stage=3, **{long: value, short: other}))
    assert len(errs) == 1 and errs[0]["type"] == "alias_conflict"
    assert long in errs[0]["msg"] and short in errs[0]["msg"] and "different values" in errs[0]["msg"]


def test_whole_float_equals_int_across_spellings() -> None:
    cfg = ZeroConfig.model_validate(
        zero_opt(stage3_prefetch_bucket_size=5e7, prefetch_bucket_size=50_000_000)
    )
    assert cfg.zero_optimization.prefetch_bucket_size == 50_000_000


def test_fp16_and_16bit_names_conflict() -> None:
    data = zero_opt(
        stage3_gather_fp16_weights_on_model_save=True, stage3_gather_16bit_weights_on_model_save=False
    )
    assert "'stage3_gather_16bit_weights_on_model_save' = False" in error_text(data)


def test_bf16_spellings_conflict() -> None:
    assert "different values" in error_text({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("data", "path", "suggestion"),
    [
        (
            zero_opt(stage3_prefetch_bucket_sz=1),
            "zero_optimization.stage3_prefetch_bucket_sz",
            "stage3_prefetch_bucket_size",
        ),
        (zero_opt(prefetch_bucket=1), "zero_optimization.prefetch_bucket", "prefetch_bucket_size"),
        ({"gradient_acumulation_steps": 2}, "gradient_acumulation_steps", "gradient_accumulation_steps"),
        ({"zero_optimisation": {}}, "zero_optimisation", "zero_optimization"),
        ({"fp16": {"enable": True}}, "fp16.enable", "enabled"),
        (
            zero_opt(offload_optimizer={"pin_memmory": True}),
            "zero_optimization.offload_optimizer.pin_memmory",
            "pin_memory",
        ),
        (zero_opt(offload_param={"devices": "cpu"}), "zero_optimization.offload_param.devices", "device"),
        ({"optimizer": {"type": "AdamW", "params": {"beta": [0.9, 0.9]}}}, "optimizer.params.beta", "betas"),
    ],
)
def test_unknown_key_names_full_path_and_closest(data: dict, path: str, suggestion: str) -> None:
    errs = errors_of(data)
    assert len(errs) == 1
    assert errs[0]["type"] == "unknown_key"
    assert errs[0]["loc"] == tuple(path.split("."))
    assert errs[0]["msg"] == f"unknown key {path!r}; did you mean {suggestion!r}?"


def test_unknown_key_in_standalone_section_still_names_deepspeed_path() -> None:
    errs = errors_of({"stage3_max_live_params": 5}, ZeroOptimizationConfig)
    assert errs[0]["msg"] == (
        "unknown key 'zero_optimization.stage3_max_live_params'; did you mean 'stage3_max_live_parameters'?"
    )


def test_unknown_key_without_close_match_lists_accepted_keys() -> None:
    msg = errors_of({"fp16": {"xyz": 1}})[0]["msg"]
    assert msg.startswith(
        "unknown key 'fp16.xyz'; keys accepted in fp16: auto_cast, consecutive_hysteresis, enabled"
    )


def test_every_unknown_key_is_reported_at_once() -> None:
    errs = errors_of({"foo": 1, "zero_optimization": {"stage": 3, "bar": 2, "offload_param": {"baz": 3}}})
    assert {e["loc"] for e in errs} == {
        ("foo",),
        ("zero_optimization", "bar"),
        ("zero_optimization", "offload_param", "baz"),
    }


@pytest.mark.parametrize(
    ("key", "hint"),
    [("amp", "fp16"), ("activation_checkpointing", "torch.utils.checkpoint")],
)
def test_known_deepspeed_keys_get_a_specific_message(key: str, hint: str) -> None:
    msg = errors_of({key: {}})[0]["msg"]
    assert msg.startswith(f"unknown key {key!r}:") and hint in msg


def test_deprecated_cpu_offload_points_to_offload_optimizer() -> None:
    msg = errors_of(zero_opt(stage=2, cpu_offload=True))[0]["msg"]
    assert '{"offload_optimizer": {"device": "cpu"}}' in msg


@pytest.mark.parametrize(
    ("data", "loc"),
    [
        ({"train_batch_size": "auto"}, ("train_batch_size",)),
        ({"gradient_clipping": "auto"}, ("gradient_clipping",)),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}},
            ("optimizer", "params", "lr"),
        ),
        (
            zero_opt(stage=3, stage3_prefetch_bucket_size="auto"),
            ("zero_optimization", "stage3_prefetch_bucket_size"),
        ),
        ({"fp16": {"enabled": "auto"}}, ("fp16", "enabled")),
    ],
)
def test_auto_values_are_errors_naming_the_key(data: dict, loc: tuple) -> None:
    errs = errors_of(data)
    first = next(e for e in errs if e["loc"] == loc)
    assert first["type"] == "auto_value"
    assert (
        first["msg"].startswith(f"{'.'.join(loc)} is 'auto':") and "replace it with a value" in first["msg"]
    )


# ----------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("data", "loc", "message"),
    [
        (zero_opt(stage=4), ("zero_optimization", "stage"), "expected a whole number in [0, 3], got 4"),
        (zero_opt(stage=-1), ("zero_optimization", "stage"), "expected a whole number in [0, 3], got -1"),
        (zero_opt(stage="3"), ("zero_optimization", "stage"), "expected a whole number in [0, 3], got '3'"),
        (
            zero_opt(reduce_bucket_size=5.5),
            ("zero_optimization", "reduce_bucket_size"),
            "whole number >= 1, got 5.5",
        ),
        (zero_opt(reduce_bucket_size=True), ("zero_optimization", "reduce_bucket_size"), "got True"),
        (zero_opt(overlap_comm=1), ("zero_optimization", "overlap_comm"), "expected true or false, got 1"),
        (
            zero_opt(overlap_comm="true"),
            ("zero_optimization", "overlap_comm"),
            "expected true or false, got 'true'",
        ),
        ({"gradient_accumulation_steps": 0}, ("gradient_accumulation_steps",), "whole number >= 1, got 0"),
        ({"gradient_clipping": -1}, ("gradient_clipping",), "expected a number >= 0, got -1"),
        ({"fp16": {"min_loss_scale": 0}}, ("fp16", "min_loss_scale"), "expected a number > 0, got 0"),
        (
            zero_opt(stage=3, offload_optimizer={"ratio": 1.5}),
            ("zero_optimization", "offload_optimizer", "ratio"),
            "expected a number in [0, 1], got 1.5",
        ),
        (
            zero_opt(offload_param={"device": "gpu"}),
            ("zero_optimization", "offload_param", "device"),
            "expected one of 'none', 'cpu', 'nvme' (any case), got 'gpu'",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
            ("optimizer", "params", "betas"),
            "expected two numbers [beta1, beta2] in [0, 1), got [0.9]",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
            ("optimizer", "params", "betas"),
            "expected a number in [0, 1), got 1",
        ),
    ],
)
def test_bad_values_name_key_and_accepted_range(data: dict, loc: tuple, message: str) -> None:
    errs = errors_of(data)
    assert [e["loc"] for e in errs] == [loc]
    assert message in errs[0]["msg"]
    assert ".".join(loc) in error_text(data)


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_without_path_is_an_error(section: str) -> None:
    text = error_text(zero_opt(stage=3, **{section: {"device": "nvme"}}))
    assert f"zero_optimization.{section}.device is 'nvme' but no nvme_path is given" in text
    ok = ZeroConfig.model_validate(
        zero_opt(stage=3, **{section: {"device": "NVMe", "nvme_path": "/local_nvme"}})
    )
    assert getattr(ok.zero_optimization, section).device is OffloadDevice.NVME


def test_partial_optimizer_offload_needs_stage_3() -> None:
    assert "needs stage 3, got stage 2" in error_text(
        zero_opt(stage=2, offload_optimizer={"device": "cpu", "ratio": 0.5})
    )
    assert ZeroConfig.model_validate(zero_opt(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.5}))


def test_offload_null_means_no_offload() -> None:
    cfg = ZeroConfig.model_validate(zero_opt(stage=3, offload_param=None, offload_optimizer=None))
    assert not cfg.zero_optimization.offload_param.enabled and cfg.unsupported_features() == []


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_offload_buffers_are_pinned_unless_pin_memory_is_set_false(section: str) -> None:
    def converted(**extra: object) -> object:
        cfg = ZeroConfig.model_validate(zero_opt(stage=3, **{section: {"device": "cpu", **extra}}))
        off = getattr(cfg.zero_optimization, section)
        return off.to_param_offload_config() if section == "offload_param" else off.to_offload_config(7)

    assert converted().pin_memory is True  # unset: pinned (used only beside an accelerator)
    assert converted(pin_memory=False).pin_memory is False
    assert converted(pin_memory=True).pin_memory is True


# ----------------------------------------------------------------------------- from_json


def test_from_json_missing_file_names_path(tmp_path) -> None:
    missing = tmp_path / "nope" / "ds.json"
    with pytest.raises(FileNotFoundError, match=f"zero config file not found: '{missing}'"):
        ZeroConfig.from_json(missing)


def test_from_json_invalid_json_gives_line_and_column(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "zero_optimization": {\n    "stage": 3,\n  }\n}\n')
    with pytest.raises(ConfigFileError) as info:
        ZeroConfig.from_json(path)
    assert str(info.value).startswith(f"{path}:4:3: invalid JSON:")


def test_from_json_duplicate_key_and_non_object(tmp_path) -> None:
    dup = tmp_path / "dup.json"
    dup.write_text('{"zero_optimization": {"stage": 1, "stage": 3}}')
    with pytest.raises(ConfigFileError, match="key 'stage' appears twice"):
        ZeroConfig.from_json(dup)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ConfigFileError, match="top level must be a JSON object, got list"):
        ZeroConfig.from_json(lst)
    with pytest.raises(ConfigFileError, match="is a directory"):
        ZeroConfig.from_json(tmp_path)


def test_from_json_validation_error_names_file(tmp_path) -> None:
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(zero_opt(stage=3, stage3_prefetch_bucket_sz=5)))
    with pytest.raises(ValidationError) as info:
        ZeroConfig.from_json(path)
    text = str(info.value)
    assert f"ZeroConfig from {path}" in text and "did you mean 'stage3_prefetch_bucket_size'?" in text


def test_coerce_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="config must be a ZeroConfig, a dict or a path"):
        ZeroConfig.coerce(3)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- unsupported / ignored


def test_zeropp_mics_and_offload_are_not_listed_as_unsupported_at_stage_3() -> None:
    cfg = ZeroConfig.model_validate(
        zero_opt(
            stage=3,
            offload_optimizer={"device": "cpu", "pin_memory": True, "ratio": 0.5},
            offload_param={"device": "nvme", "nvme_path": "/nvme"},
            zero_quantized_weights=True,
            zero_quantized_gradients=True,
            zero_hpz_partition_size=2,
            zeropp_loco_param={"err_beta": 0.5, "reset_T": 7},
            mics_shard_size=2,
            mics_hierarchical_params_gather=True,
        )
    )
    assert cfg.unsupported_features() == []  # ZeRO++, MiCS and offload are implemented
    loco = cfg.zero_optimization.zeropp_loco_param.to_feedback_config()
    assert (loco.err_beta, loco.reset_t) == (0.5, 7)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_parameter_offload_is_supported_at_stage_3(device: str) -> None:
    section = {"device": device, "nvme_path": "/nvme", "buffer_count": 3, "buffer_size": 10, "max_in_cpu": 20}
    cfg = ZeroConfig.model_validate(zero_opt(stage=3, offload_param=section))
    assert cfg.unsupported_features() == []
    converted = cfg.zero_optimization.offload_param.to_param_offload_config()
    assert converted.device.value == device
    assert (converted.buffer_count, converted.buffer_size, converted.max_in_cpu) == (3, 10, 20)
    assert str(converted.nvme_path) == "/nvme"
    plain = ZeroConfig.model_validate(zero_opt(stage=3))
    assert plain.zero_optimization.offload_param.to_param_offload_config() is None


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_whole_optimizer_offload_is_supported_at_stages_1_to_3(stage: int, device: str) -> None:
    cfg = ZeroConfig.model_validate(
        zero_opt(stage=stage, offload_optimizer={"device": device, "nvme_path": "/nvme", "buffer_count": 3})
    )
    assert cfg.unsupported_features() == []
    off = cfg.zero_optimization.offload_optimizer.to_offload_config(123)
    assert (off.device.value, off.buffer_count, off.sub_group_size) == (device, 3, 123)


def test_offload_fast_init_is_listed_as_ignored() -> None:
    cfg = ZeroConfig.model_validate(zero_opt(stage=2, offload_optimizer={"device": "cpu", "fast_init": True}))
    assert "zero_optimization.offload_optimizer.fast_init" in cfg.zero_optimization.ignored_keys()


def test_other_unsupported_switches() -> None:
    cfg = ZeroConfig.model_validate(
        {
            "fp16": {"enabled": True, "auto_cast": True},
            **zero_opt(stage=1, load_from_fp32_weights=False, ignore_unused_parameters=False),
        }
    )
    assert len(cfg.unsupported_features()) == 3


def test_stage3_knobs_under_stage_2_are_ignored_not_unsupported() -> None:
    cfg = ZeroConfig.model_validate(
        zero_opt(
            stage=2,
            prefetch_bucket_size=10,
            stage3_max_live_parameters=10,
            stage3_module_granularity_threshold=10,
            stage3_gather_fp16_weights_on_model_save=True,
            offload_param={"device": "cpu"},
            mics_shard_size=4,
            reduce_bucket_size=10,
        )
    )
    assert cfg.unsupported_features() == []
    assert cfg.ignored_keys() == [  # in declaration order
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_module_granularity_threshold",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.mics_shard_size",
        "zero_optimization.offload_param",
    ]


def test_sub_group_size_has_an_effect_at_every_stage() -> None:
    for stage in range(4):
        cfg = ZeroConfig.model_validate(zero_opt(stage=stage, sub_group_size=1000))
        assert cfg.ignored_keys() == [], stage


def test_other_ignored_keys() -> None:
    cfg = ZeroConfig.model_validate(
        {
            "wall_clock_breakdown": True,
            "fp16": {"enabled": False, "loss_scale_window": 100},
            "optimizer": {"type": "AdamW", "params": {"adam_w_mode": True, "torch_adam": True}},
            **zero_opt(
                stage=3,
                allgather_bucket_size=10,
                round_robin_gradients=True,
                offload_param={"nvme_path": "/x"},
            ),
        }
    )
    assert cfg.ignored_keys() == [  # in declaration order
        "wall_clock_breakdown",
        "fp16.loss_scale_window",
        "optimizer.params.adam_w_mode",
        "optimizer.params.torch_adam",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.offload_param.nvme_path",
    ]
    assert ZeroConfig.model_validate(
        zero_opt(stage=0, offload_optimizer={"device": "cpu"})
    ).ignored_keys() == ["zero_optimization.offload_optimizer"]


# ----------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        (
            {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8},
            2,
            (64, 4, 8),
        ),
        ({"train_batch_size": 63, "train_micro_batch_size_per_gpu": 7}, 3, (63, 7, 3)),
        ({"train_batch_size": 84, "gradient_accumulation_steps": 3}, 4, (84, 7, 3)),
        ({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3}, 2, (30, 5, 3)),
        ({"train_batch_size": 14}, 2, (14, 7, 1)),
        ({"train_micro_batch_size_per_gpu": 1}, 1, (1, 1, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 4, (12, 3, 1)),
    ],
)
def test_resolve_batch_fills_the_missing_numbers(given: dict, world: int, expected: tuple) -> None:
    assert ZeroConfig.model_validate(given).resolve_batch(world) == BatchSizes(*expected, world)


def test_resolve_batch_inconsistent_names_the_numbers() -> None:
    cfg = ZeroConfig.model_validate(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    )
    with pytest.raises(ValueError) as info:
        cfg.resolve_batch(4)
    msg = str(info.value)
    assert (
        "train_batch_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8, world_size=4"
        in msg
    )
    assert (
        "with world size 4, micro-batch 4 and gradient accumulation 8, "
        "train_batch_size must be 4 * 8 * 4 = 128" in msg
    )


@pytest.mark.parametrize(
    ("given", "world", "hint"),
    [
        (
            {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3},
            1,
            "with world size 1 and micro-batch 3, train_batch_size must be a multiple of 3 (e.g. 9 or 12), "
            "got 10",
        ),
        (
            {"train_batch_size": 10, "gradient_accumulation_steps": 3},
            2,
            "with world size 2 and gradient accumulation 3, train_batch_size must be a multiple of 6 "
            "(e.g. 6 or 12), got 10",
        ),
        (
            {"train_batch_size": 7},
            2,
            "with world size 2 and gradient accumulation 1, train_batch_size must be a multiple of 2 "
            "(e.g. 6 or 8), got 7",
        ),
        (
            {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4},
            1,
            "with world size 1 and micro-batch 4, train_batch_size must be a multiple of 4 (e.g. 4 or 8), "
            "got 2",
        ),
        (
            {"train_batch_size": 20, "train_micro_batch_size_per_gpu": 8},
            3,
            "with world size 3 and micro-batch 8, train_batch_size must be a multiple of 24 (e.g. 24 or 48), "
            "got 20",
        ),
    ],
)
def test_resolve_batch_says_which_values_work(given: dict, world: int, hint: str) -> None:
    with pytest.raises(ValueError) as info:
        ZeroConfig.model_validate(given).resolve_batch(world)
    assert hint in str(info.value)
    assert "inconsistent batch sizes (train_batch_size=" in str(info.value)  # the numbers given, too


def test_resolve_batch_needs_a_batch_size() -> None:
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        ZeroConfig.model_validate({"gradient_accumulation_steps": 2}).resolve_batch(2)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        ZeroConfig.model_validate({"train_batch_size": 2}).resolve_batch(0)


# ----------------------------------------------------------------------------- lower-package configs


def test_coordinator_config_mapping() -> None:
    from zero_coord import CoordinatorConfig

    cfg = ZeroConfig.model_validate(
        zero_opt(
            stage=3,
            stage3_prefetch_bucket_size=1023,
            max_live_parameters=7,
            stage3_max_reuse_distance=0,
            stage3_module_granularity_threshold=5e4,
        )
    )
    assert cfg.zero_optimization.to_coordinator_config() == CoordinatorConfig(
        prefetch_bucket_size=1023,
        max_live_parameters=7,
        max_reuse_distance=0,
        module_granularity_threshold=50_000,
    )
    assert ZeroConfig().zero_optimization.to_coordinator_config() == CoordinatorConfig()  # same defaults


def test_reduce_config_mapping() -> None:
    from zero_optim.buckets import ReduceConfig

    cfg = ZeroConfig.model_validate(zero_opt(stage=2, reduce_bucket_size=5e7, overlap_comm=True))
    assert cfg.zero_optimization.to_reduce_config() == ReduceConfig(
        reduce_bucket_size=50_000_000, overlap_comm=True
    )
    assert (
        ZeroConfig.model_validate(zero_opt(stage=3)).zero_optimization.to_reduce_config().overlap_comm is True
    )


def test_mics_hierarchical_gather_without_mics_is_an_error_naming_both_keys() -> None:
    with pytest.raises(ValidationError, match="mics_hierarchical_params_gather") as info:
        ZeroConfig.model_validate(zero_opt(stage=3, mics_hierarchical_params_gather=True))
    assert "mics_shard_size" in str(info.value) and "-1" in str(info.value)
    ok = ZeroConfig.model_validate(zero_opt(stage=3, mics_shard_size=2, mics_hierarchical_params_gather=True))
    assert ok.zero_optimization.mics_enabled and ok.unsupported_features() == []
