"""The zero config of a Lightning run: the user's dict completed from the ``Trainer``'s settings.

Lightning owns accumulation (``accumulate_grad_batches``), clipping (``gradient_clip_val``)
and precision (``precision=``); the zero config may leave them out or say ``"auto"``, and a
value that disagrees with the Trainer is an error naming both (one source of truth per run).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zero_full.config.auto import take_trainer_value

__all__ = ["fill_from_trainer", "load_raw"]

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")


def load_raw(config: Mapping[str, Any] | str | os.PathLike[str] | None, stage: int | None) -> dict[str, Any]:
    """A private copy of the user's config as a dict (a JSON path is read), with ``stage`` set if given.

    Raises:
        ValueError: ``stage`` and the config's ``zero_optimization.stage`` disagree.
    """
    if config is None:
        raw: dict[str, Any] = {}
    elif isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config))
    else:
        raw = json.loads(Path(config).read_text())
    if stage is not None:
        section = raw.setdefault("zero_optimization", {})
        given = section.get("stage")
        if given is not None and given != "auto" and int(given) != stage:
            raise ValueError(
                f"ZeroStrategy(stage={stage}) but the config's zero_optimization.stage is {given}: keep one"
            )
        section["stage"] = stage
    return raw


def _settle(raw: dict[str, Any], key: str, value: Any, trainer_setting: str) -> None:
    """Set ``raw[key]`` to the Trainer's ``value`` unless the config holds a different explicit value."""
    trainer = f"the Lightning Trainer has {trainer_setting}"
    fix = f'remove {key} from the config (or set it to "auto") or change the Trainer'
    take_trainer_value(raw, key, value, path=key, trainer=trainer, fix=fix)


def fill_from_trainer(
    raw: dict[str, Any], *, accumulate: int, clip_val: float | None, precision_section: str | None
) -> dict[str, Any]:
    """Complete ``raw`` (in place, and returned) from the Trainer's accumulation, clipping and precision.

    Batch-size keys that say ``"auto"`` are dropped: Lightning's data loaders set the batch,
    and the engine only needs ``gradient_accumulation_steps``.

    Raises:
        ValueError: a config value disagrees with the Trainer's (both named), or a
            precision section is enabled that the Trainer's ``precision`` does not ask for.
    """
    for key in _BATCH_KEYS:
        if raw.get(key) == "auto":
            del raw[key]
    _settle(raw, "gradient_accumulation_steps", accumulate, f"accumulate_grad_batches={accumulate}")
    _settle(raw, "gradient_clipping", float(clip_val or 0.0), f"gradient_clip_val={clip_val}")
    for section in ("fp16", "bf16"):
        wanted = section == precision_section
        body = raw.get(section)
        if body is None:
            if wanted:
                raw[section] = {"enabled": True}
            continue
        enabled = body.get("enabled", True)
        if enabled == "auto":
            body["enabled"] = wanted
        elif bool(enabled) != wanted:
            raise ValueError(
                f"the zero config's {section}.enabled is {enabled} but the Lightning Trainer's precision "
                f"{'asks for' if wanted else 'does not ask for'} {section}; set Trainer(precision=...) to "
                'match or set the section\'s enabled to "auto"'
            )
    return raw
