"""``ZeroStrategyBase``: what the Trainer's and Fabric's zero strategies hold alike.

The user's zero config (``stage`` applied, see :func:`zero_full.lightning.config.load_raw`) and
the engine once it is built. It stands before Lightning's or Fabric's ``DDPStrategy`` in a
strategy's bases and hands the DDP arguments on to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, ClassVar

import torch

from zero_full.engine import Engine
from zero_full.lightning.config import load_raw

try:
    from lightning.fabric.accelerators import Accelerator
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
except ImportError as exc:  # the extra is not installed
    raise ImportError("zero_full.lightning needs Lightning: pip install 'zero-full[lightning]'") from exc

__all__ = ["ZeroStrategyBase"]


class ZeroStrategyBase:
    """The zero config of a strategy and its engine (``None`` until the strategy builds it).

    Args:
        stage: ZeRO stage (1, 2 or 3); sets ``zero_optimization.stage`` (``None``: the config's).
        config: A DeepSpeed-style dict or JSON path.
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
        process_group_backend, timeout: As for the ``DDPStrategy`` that follows in the bases.
    """

    _NO_ENGINE_YET: ClassVar[str] = "the zero engine is not built yet"
    """The error of a call that needs the engine before the strategy built it: says what builds it."""

    def __init__(
        self,
        stage: int | None = None,
        config: Mapping[str, Any] | str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        # The first four are positional alike in Lightning's and Fabric's DDPStrategy.
        super().__init__(
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._raw = load_raw(config, stage)
        self.engine: Engine | None = None

    def _require_engine(self) -> Engine:
        """The engine; ``RuntimeError`` naming what builds it when it is not built yet."""
        if self.engine is None:
            raise RuntimeError(self._NO_ENGINE_YET)
        return self.engine
