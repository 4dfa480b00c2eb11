"""``"auto"`` values of a DeepSpeed-style config, filled from Hugging Face ``TrainingArguments``.

As Hugging Face's ``HfTrainerDeepSpeedConfig`` does for DeepSpeed: the batch sizes,
accumulation, clipping, precision and optimizer hyper-parameters come from the Trainer's
arguments, the bucket sizes from the model's ``hidden_size``. A key left out is filled the
same way; an explicit value that disagrees with ``TrainingArguments`` is an error naming both.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zero_full.config.auto import take_trainer_value

__all__ = ["fill_from_training_args"]


def _settle(section: dict[str, Any], key: str, value: Any, path: str, source: str) -> None:
    trainer = f"TrainingArguments has {source}={value!r}"
    fix = f'set {path} to "auto" (or leave it out) or change TrainingArguments'
    take_trainer_value(section, key, value, path=path, trainer=trainer, fix=fix)


def _fill_if_auto(section: dict[str, Any], key: str, value: Any) -> None:
    if section.get(key) == "auto":
        section[key] = value


def fill_from_training_args(
    config: Mapping[str, Any] | str | os.PathLike[str], args: Any, world_size: int, hidden_size: int | None
) -> dict[str, Any]:
    """A copy of ``config`` with ``"auto"`` (and missing trainer-owned) values taken from ``args``."""
    raw = copy.deepcopy(dict(config)) if isinstance(config, Mapping) else json.loads(Path(config).read_text())
    if "scheduler" in raw:
        raise ValueError(
            "the zero config has a 'scheduler' section: ZeroTrainer steps the Trainer's own schedule "
            "(TrainingArguments lr_scheduler_type, warmup_steps / warmup_ratio); remove the section"
        )
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    _settle(raw, "train_micro_batch_size_per_gpu", micro, "train_micro_batch_size_per_gpu",
            "per_device_train_batch_size")  # fmt: skip
    _settle(raw, "gradient_accumulation_steps", accumulation, "gradient_accumulation_steps",
            "gradient_accumulation_steps")  # fmt: skip
    _settle(raw, "train_batch_size", micro * accumulation * world_size, "train_batch_size",
            "per_device_train_batch_size x gradient_accumulation_steps x world size")  # fmt: skip
    _settle(raw, "gradient_clipping", float(args.max_grad_norm or 0.0), "gradient_clipping", "max_grad_norm")
    for name, wanted in (("fp16", bool(args.fp16)), ("bf16", bool(args.bf16))):
        section = raw.setdefault(name, {})
        if wanted or section.get("enabled") is not None:
            _settle(section, "enabled", wanted, f"{name}.enabled", name)
    optimizer = raw.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.setdefault("params", {})
        _fill_if_auto(params, "lr", args.learning_rate)
        _fill_if_auto(params, "betas", [args.adam_beta1, args.adam_beta2])
        _fill_if_auto(params, "eps", args.adam_epsilon)
        _fill_if_auto(params, "weight_decay", args.weight_decay)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict) and hidden_size is not None:
        _fill_if_auto(zero, "reduce_bucket_size", hidden_size * hidden_size)
        _fill_if_auto(zero, "stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size))
        _fill_if_auto(zero, "stage3_param_persistence_threshold", 10 * hidden_size)
    return raw
