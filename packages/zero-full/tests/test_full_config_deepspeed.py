"""DeepSpeed configs taken as DeepSpeed takes them: a corpus of real files, reported keys, "auto" values."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import types

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import zero_full
from zero_full.config.compat import ConfigError, FindingKind
from zero_full.config.prepare import prepare_config, validate_deepspeed

CORPUS = pathlib.Path(__file__).parent / "data" / "deepspeed_configs"
SNAPSHOT = pathlib.Path(__file__).parent / "data" / "deepspeed_configs_snapshot.txt"
FILES = sorted(CORPUS.glob("*.json"))


def _outcome(path: pathlib.Path) -> list[str]:
    """What becomes of one file: its refusal, or each reported key with what happened to it."""
    try:
        _, report = validate_deepspeed(path)
    except ConfigError as exc:
        return ["refused: " + line.split(" = ")[0].strip(" -") for line in str(exc).splitlines()[1:]]
    except ValidationError as exc:
        if all(e["type"] == "refused_type" for e in exc.errors()):
            return [
                f"refused: {'.'.join(map(str, e['loc']))} = {e['msg'].split(' = ')[1].split(':')[0]}"
                for e in exc.errors()
            ]
        raise
    return [f"{f.kind.value}: {f.path}" for f in report.findings]


def _snapshot() -> str:
    return "".join(f"{f.name}\n" + "".join(f"  {line}\n" for line in _outcome(f)) for f in FILES)


def test_the_corpus_is_real_and_sourced():
    sources = (CORPUS / "SOURCES.md").read_text(encoding="utf-8")
    assert len(FILES) >= 40
    for f in FILES:
        assert f"`{f.name}`" in sources, f.name
        json.loads(f.read_text(encoding="utf-8"))
    assert len({f.name.split("__")[0] for f in FILES}) >= 6  # projects


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_every_corpus_file_validates_or_is_refused_by_name(path):
    outcome = _outcome(path)  # raises for anything but a refusal by name
    refused = [line for line in outcome if line.startswith("refused")]
    assert all(line.split(": ", 1)[1] for line in refused)


def test_the_corpus_snapshot_lists_what_was_ignored_resolved_or_refused():
    text = _snapshot()
    if os.environ.get("ZERO_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(text, encoding="utf-8")
    assert text == SNAPSHOT.read_text(encoding="utf-8"), (
        "the corpus outcome changed; review it and rewrite the snapshot with ZERO_UPDATE_SNAPSHOT=1"
    )
    assert text.count("refused:") >= 5 and text.count("auto:") >= 20


CIFAR = {  # DeepSpeedExamples training/cifar, as the user fed it in
    "train_batch_size": 16,
    "steps_per_print": 2000,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
    },
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "bf16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 15,
    },
    "fp16": {"enabled": False, "fp16_master_weights_and_grads": False},
    "wall_clock_breakdown": False,
    "zero_optimization": {
        "stage": 0,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 50000000,
        "reduce_bucket_size": 50000000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "cpu_offload": False,
    },
}


def test_the_cifar_config_validates_with_its_no_op_values_silent():
    cfg, report = validate_deepspeed(CIFAR)
    paths = {f.path: f.kind for f in report.findings}
    assert cfg.precision.value == "bf16" and cfg.scheduler.type.value == "WarmupLR"
    for silent in (
        "prescale_gradients",
        "zero_optimization.cpu_offload",
        "fp16.fp16_master_weights_and_grads",
    ):
        assert silent not in paths
    for key in ("loss_scale_window", "hysteresis", "min_loss_scale", "initial_scale_power"):
        assert paths[f"bf16.{key}"] is FindingKind.IGNORED
    assert "bf16.loss_scale" not in paths  # 0: what bf16 does anyway


def test_an_unknown_key_is_reported_with_the_closest_and_strict_makes_it_an_error():
    raw = {"zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 10}, "my_tool": {"x": 1}}
    _, report = validate_deepspeed(raw)
    unknown = {f.path: f.why for f in report.of_kind(FindingKind.UNKNOWN)}
    assert (
        "zero_optimization.stage3_param_persistence_threshold"
        in unknown["zero_optimization.stage3_param_persitence_threshold"]
    )
    assert "my_tool" in unknown
    with pytest.raises(
        ConfigError, match=r"unknown key zero_optimization\.stage3_param_persitence_threshold"
    ):
        validate_deepspeed(raw, strict=True)
    with pytest.raises(ValidationError, match="stage3_param_persistence_threshold"):  # today's strict path
        zero_full.ZeroConfig.model_validate(raw)


@pytest.mark.parametrize(
    ("raw", "culprit"),
    [
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads",
        ),
        ({"pipeline": {"stages": 2}}, "pipeline = .*pipeline parallelism"),
        ({"moe": {"enabled": True}}, "moe = .*mixture-of-experts"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum_learning"),
        ({"amp": {"enabled": True}}, "amp = .*Apex"),
    ],
)
def test_what_zero_cannot_honour_is_refused_by_name(raw, culprit):
    with pytest.raises(ConfigError, match=culprit):
        validate_deepspeed(raw)


def test_disabled_feature_sections_and_no_op_values_are_silent():
    raw = {
        "curriculum_learning": {"enabled": False},
        "data_efficiency": {"enabled": False},
        "amp": {"enabled": False},
        "tensorboard": {"enabled": False, "output_path": "x"},
        "zero_allow_untested_optimizer": True,
        "gradient_predivide_factor": 1.0,
        "zero_optimization": {"stage": 2, "cpu_offload": False, "elastic_checkpoint": True},
    }
    assert validate_deepspeed(raw)[1].findings == ()


def test_deprecated_cpu_offload_becomes_offload_optimizer():
    cfg, report = validate_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device.value == "cpu"
    assert [f.kind for f in report.findings] == [FindingKind.RESOLVED]


class _HF(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=hidden)
        self.layer = nn.Linear(hidden, hidden)


HF_AUTO = json.loads(
    (CORPUS / "transformers__tests_deepspeed_ds_config_zero3.json").read_text(encoding="utf-8")
)


def test_auto_values_are_resolved_by_the_trainer_rules():
    raw = {**HF_AUTO, "train_micro_batch_size_per_gpu": 4}
    raw["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}}
    cfg, report = prepare_config(raw, _HF(8), world_size=2)
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (64, 57, 80)
    assert cfg.resolve_batch(2).train_batch_size == 8 and cfg.gradient_accumulation_steps is None
    assert cfg.optimizer.params.lr == 5e-5 and cfg.scheduler.params.warmup_max_lr == 5e-5
    assert cfg.gradient_clipping == 1.0 and not cfg.fp16.enabled
    resolved = {f.path: f.value for f in report.of_kind(FindingKind.RESOLVED)}
    assert resolved["zero_optimization.reduce_bucket_size"] == 64 and resolved["train_batch_size"] == 8


@pytest.mark.parametrize(
    ("change", "culprit"),
    [
        ({}, r"scheduler\.params\.warmup_num_steps"),  # a step count needs a Trainer
        ({"train_micro_batch_size_per_gpu": "auto", "scheduler": None}, "train_micro_batch_size_per_gpu"),
    ],
)
def test_an_auto_that_cannot_be_derived_names_the_key(change, culprit):
    raw = {**HF_AUTO, "train_micro_batch_size_per_gpu": 4, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=culprit):
        prepare_config(raw, _HF(8), world_size=2)


def test_a_model_without_a_hidden_size_cannot_resolve_bucket_sizes():
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    }
    with pytest.raises(ConfigError, match=r"zero_optimization\.reduce_bucket_size"):
        prepare_config(raw, nn.Linear(2, 2), world_size=1)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _initialize_logs(rank) -> list[tuple[int, str]]:
    handler = _Records()
    logging.getLogger("zero.engine").addHandler(handler)
    try:
        raw = {**CIFAR, "train_batch_size": 2 * rank.world_size, "memory_breakdown": True}
        raw["zero_optimization"] = {
            **CIFAR["zero_optimization"],
            "stage": 1,
            "stage3_param_persitence_threshold": 1,
        }
        engine = zero_full.initialize(_HF(4), raw)
        engine.close()
    finally:
        logging.getLogger("zero.engine").removeHandler(handler)
    return [
        (r.levelno, r.getMessage()) for r in handler.records if "did not simply take effect" in r.getMessage()
    ]


def test_initialize_reports_once_on_rank_zero_at_warning(dist):
    logs = dist.run(2, _initialize_logs)
    assert logs[1] == [] and len(logs[0]) == 1
    level, text = logs[0][0]
    assert level == logging.WARNING
    for key in ("stage3_param_persitence_threshold", "memory_breakdown", "bf16.hysteresis"):
        assert key in text
    assert text.index("persitence") < text.index("memory_breakdown")  # unknown keys first
    assert torch.distributed.is_available()
