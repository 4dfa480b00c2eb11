"""``"auto"`` values of Hugging Face Trainer configs, filled in from the model and the batch settings."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

from zero_full.config.compat import ConfigError, ConfigReport, Finding, FindingKind, is_auto

__all__ = ["hidden_size", "resolve_auto"]

_TRAINER_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("optimizer", "params", "lr"): 5e-5,
    ("optimizer", "params", "betas"): [0.9, 0.999],
    ("optimizer", "params", "eps"): 1e-8,
    ("optimizer", "params", "weight_decay"): 0.0,
    ("gradient_clipping",): 1.0,
    ("fp16", "enabled"): False,
    ("bf16", "enabled"): False,
    ("bfloat16", "enabled"): False,
    ("scheduler", "params", "warmup_min_lr"): 0.0,
}
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def hidden_size(model: nn.Module) -> int | None:
    """The model's hidden size as the Trainer integration reads it from ``model.config``, if any."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    sizes = getattr(config, "hidden_sizes", None)
    if sizes:
        return int(max(sizes))
    for name in ("hidden_size", "d_model", "n_embd"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def take_trainer_value(
    section: dict[str, Any], key: str, value: Any, *, path: str, trainer: str, fix: str
) -> None:
    """Set ``section[key]`` to a trainer's ``value`` unless the config holds a different explicit value.

    A key left out or set to ``"auto"`` takes ``value``; one already equal to it stays.

    Args:
        section: The config dict (or section) holding ``key``; changed in place.
        key: The key in ``section``.
        value: The trainer's value.
        path: The key as the error names it in the config.
        trainer: The trainer's setting as the error names it (``"TrainingArguments has ..."``).
        fix: What to do, the end of the error.

    Raises:
        ValueError: the config's value differs: "the zero config sets <path>=<given> but <trainer>; <fix>".
    """
    given = section.get(key)
    if given is None or given == "auto":
        section[key] = value
    elif given != value:
        raise ValueError(f"the zero config sets {path}={given!r} but {trainer}; {fix}")


def _auto_paths(node: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, (*path, k))]
    if is_auto(node) or (isinstance(node, list) and any(is_auto(v) for v in node)):
        return [path]
    return []


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = raw
    for part in path[:-1]:
        node = node[part]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def _get(raw: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = raw
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _from_hidden(model: nn.Module) -> dict[str, Callable[[int], int]]:
    return {
        "reduce_bucket_size": lambda h: h * h,
        "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda h: 10 * h,
        "param_persistence_threshold": lambda h: 10 * h,
    }


def _resolve_one(raw: dict[str, Any], path: tuple[str, ...], model: nn.Module) -> tuple[Any, str] | None:
    """``(value, how)`` for one ``"auto"`` (``value`` None: the key is dropped), or None: not derivable."""
    if path in _TRAINER_DEFAULTS:
        return _TRAINER_DEFAULTS[path], "the Hugging Face Trainer's default"
    if path == ("scheduler", "params", "warmup_max_lr"):
        lr = _get(raw, ("optimizer", "params", "lr"))
        if isinstance(lr, int | float):
            return lr, "the optimizer's lr"
        return None
    if len(path) == 1 and path[0] in _BATCH:
        return None, "derived from the other batch keys and the world size"
    rules = _from_hidden(model)
    if path[:1] == ("zero_optimization",) and len(path) == 2 and path[1] in rules:
        hidden = hidden_size(model)
        if hidden is None:
            return None
        return rules[path[1]](hidden), f"from the model's hidden size {hidden}"
    return None


def resolve_auto(
    raw: dict[str, Any], model: nn.Module, world_size: int
) -> tuple[dict[str, Any], ConfigReport]:
    """``raw`` with every ``"auto"`` filled in, and the report of what was filled in."""
    resolved = copy.deepcopy(raw)
    findings, missing = [], []
    for path in _auto_paths(raw):
        found = _resolve_one(resolved, path, model)
        dotted = ".".join(path)
        if found is None:
            missing.append(dotted)
            continue
        value, how = found
        _set(resolved, path, value)
        shown = value if value is not None else _derived_batch(resolved, path[-1], world_size)
        findings.append(Finding(dotted, shown, FindingKind.RESOLVED, f'"auto": {how}'))
    if missing:
        lines = "\n  - ".join(
            f'{m} is "auto" and cannot be derived without a Trainer: give its value' for m in missing
        )
        raise ConfigError(f'"auto" values zero cannot fill in:\n  - {lines}')
    if all(resolved.get(k) is None for k in _BATCH[:2]) and any(is_auto(raw.get(k)) for k in _BATCH):
        raise ConfigError(
            'train_micro_batch_size_per_gpu and train_batch_size are "auto" (or absent): zero derives one '
            "batch key from the others, so give the micro-batch size (or the global batch size)"
        )
    return resolved, ConfigReport(tuple(findings))


def _derived_batch(raw: dict[str, Any], key: str, world_size: int) -> Any:
    """The value DeepSpeed's rule gives ``key`` (for the report); ``None`` when it cannot."""
    train, micro, accum = (raw.get(k) for k in _BATCH)
    if not all(isinstance(v, int | float | type(None)) for v in (train, micro, accum)):
        return None
    if micro is not None:
        accum = accum or ((train // (micro * world_size)) if train else 1)
        values = {"train_batch_size": micro * accum * world_size, "gradient_accumulation_steps": accum}
        return values.get(key, micro)
    if train is not None:
        accum = accum or 1
        values = {
            "train_micro_batch_size_per_gpu": train // (accum * world_size),
            "gradient_accumulation_steps": accum,
        }
        return values.get(key, train)
    return None
