"""``deepspeed.zero``: partition while constructing, gather for a moment, external parameters.

``Init`` is :class:`zero_full.Init` under DeepSpeed's argument names;
``GatheredParameters`` and ``register_external_parameter`` are zero_params' own, which
already take DeepSpeed's arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero_full.engine import Init as _ZeroInit
from zero_params import GatheredParameters, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]


class Init(_ZeroInit):
    """Partition every parameter as the model is constructed (``with deepspeed.zero.Init(...):``)."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        refused = [k for k, v in kwargs.items() if v not in (None, False)]
        if module is not None:
            refused.append("module")
        if mpu is not None:
            refused.append("mpu")
        if refused:
            raise ValueError(
                f"deepspeed.zero.Init: {', '.join(refused)} not supported by zero. Build the model inside "
                "`with zero.Init(config_dict_or_path=cfg):`, or build it whole and let initialize() "
                "partition it; zero is data-parallel only (no mpu)"
            )
        options: dict[str, Any] = {} if enabled else {"enabled": False}  # else: stage 3 of the config
        if data_parallel_group is not None:
            options["group"] = data_parallel_group
        if remote_device not in (None, "none"):
            options["remote_device"] = remote_device
        if dtype is not None:
            options["dtype"] = dtype
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        super().__init__(config=cfg, **options)
