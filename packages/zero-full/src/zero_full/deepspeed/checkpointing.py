"""``deepspeed.checkpointing``: activation checkpointing through ``torch.utils.checkpoint``.

``checkpoint(function, *args)`` recomputes ``function``'s activations in the backward
(non-reentrant, the mode torch recommends). DeepSpeed's partitioned or CPU-offloaded
activations are not offered: :func:`configure` refuses them by name.
"""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint

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
    refused = {
        "mpu_": mpu_ is not None,
        "partition_activations": bool(partition_activations),
        "checkpoint_in_cpu": bool(checkpoint_in_cpu),
    }
    named = [k for k, v in refused.items() if v]
    if named:
        raise ValueError(
            f"deepspeed.checkpointing.configure: {', '.join(named)} not supported by zero (no model "
            "parallelism, no partitioned or offloaded activations); drop them: checkpointing.checkpoint "
            "recomputes the activations with torch.utils.checkpoint"
        )


def is_configured() -> bool:
    """Always ``True``: :func:`checkpoint` needs no setup."""
    return True
