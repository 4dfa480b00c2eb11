"""``deepspeed.checkpointing``: activation checkpointing through ``torch.utils.checkpoint``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.utils.checkpoint

from zero_full.config.zero_config import ZeroConfig

__all__ = ["checkpoint", "configure", "is_configured"]


def checkpoint(function: Any, *args: Any) -> Any:
    """Run ``function(*args)`` without keeping its activations (``torch.utils.checkpoint``)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Accept DeepSpeed's activation-checkpointing setup; refuse what zero does not do.

    Raises:
        ValueError: ``mpu_``, ``partition_activations`` or ``checkpoint_in_cpu`` (model
            parallelism and partitioned / offloaded activations are not in zero: use
            :func:`checkpoint`, which keeps no activations at all).
    """
    section = _section(deepspeed_config)
    if partition_activations is None:  # an argument overrides the config, as in DeepSpeed
        partition_activations = section.get("partition_activations")
    if checkpoint_in_cpu is None:
        checkpoint_in_cpu = section.get("cpu_checkpointing")
    refused = {
        "mpu_": mpu_ is not None,
        "partition_activations": bool(partition_activations),
        "checkpoint_in_cpu (activation_checkpointing.cpu_checkpointing)": bool(checkpoint_in_cpu),
    }
    named = [k for k, v in refused.items() if v]
    if named:
        raise ValueError(
            f"deepspeed.checkpointing.configure: {', '.join(named)} not supported by zero (no model "
            "parallelism, no partitioned or offloaded activations); drop them: checkpointing.checkpoint "
            "recomputes the activations with torch.utils.checkpoint"
        )


def _section(deepspeed_config: Any) -> Mapping[str, Any]:
    """The ``activation_checkpointing`` section of a config dict or JSON file (empty without one)."""
    if deepspeed_config is None:
        return {}
    raw = deepspeed_config if isinstance(deepspeed_config, Mapping) else None
    if raw is None and isinstance(deepspeed_config, str | os.PathLike):
        raw = ZeroConfig.read_json(deepspeed_config)
    if raw is None:
        raise TypeError(
            "deepspeed.checkpointing.configure(deepspeed_config=...) takes a config dict or the path "
            f"of a JSON file, got {type(deepspeed_config).__name__}"
        )
    section = raw.get("activation_checkpointing") or {}
    return section if isinstance(section, Mapping) else {}


def is_configured() -> bool:
    """Always ``True``: :func:`checkpoint` needs no setup."""
    return True
