"""``ZeroStrategy``: train a LightningModule with zero (stages 1-3, MiCS, ZeRO++, offload by config).

Lifecycle, as Lightning drives it (``Trainer.fit`` / ``validate`` / ``predict``):

1. ``setup_environment``: the process group (Lightning's DDP launch: ``devices=N`` spawns,
   ``torchrun`` is detected) and the precision flag checked and replaced by
   :class:`ZeroPrecision` (an unsupported one is an error here, before any model code runs).
2. ``configure_model`` runs under :meth:`ZeroStrategy.model_sharded_context`, i.e. inside
   ``zero_full.Init``: under stage 3 each parameter is partitioned as it is created.
3. ``setup``: ``configure_optimizers`` is called (one optimizer, at most one scheduler),
   and ``zero_full.initialize`` builds the engine over the LightningModule itself with the
   user's optimizer (remapped onto the flat partitions; its ``param_groups`` stay the
   scheduler's, so Lightning's scheduler stepping changes the engine's learning rate).
4. Each batch: ``backward`` and the step go through the engine (the strategy handles
   accumulation: ``engine.step()`` runs on every batch and steps at the boundary).
5. Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``) are directories: zero's
   sharded checkpoint under ``checkpoint/`` plus Lightning's own state (loops, callbacks,
   schedulers) in ``lightning_state.pt``; ``fit(ckpt_path=...)`` restores both.

The engine outlives ``fit``: ``validate`` / ``predict`` after it run on the same shards.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

import zero_params
from zero_full.config.zero_config import ZeroConfig
from zero_full.engine import Init, initialize
from zero_full.lightning.base import ZeroStrategyBase
from zero_full.lightning.config import fill_from_trainer, load_raw
from zero_full.lightning.precision import PRECISIONS, ZeroPrecision

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as exc:  # the extra is not installed
    raise ImportError("zero_full.lightning needs Lightning: pip install 'zero-full[lightning]'") from exc

__all__ = ["ZeroStrategy"]

CHECKPOINT_TAG = "checkpoint"
"""Sub-directory of a Lightning checkpoint path that holds zero's sharded checkpoint."""
LIGHTNING_STATE = "lightning_state.pt"
"""File of a Lightning checkpoint path that holds Lightning's own state (rank 0 writes it)."""

_PLUGINS = (Precision, MixedPrecision, HalfPrecision, ZeroPrecision)


class ZeroStrategy(ZeroStrategyBase, DDPStrategy):
    """Lightning strategy training with zero.

    ``Trainer(strategy="zero_stage_3")`` after ``import zero_full.lightning``, or
    ``Trainer(strategy=ZeroStrategy(config=ds_style_dict))`` for every other setting
    (MiCS, ZeRO++, offload, buckets, ``communication_data_type`` ...).

    Args:
        stage: ZeRO stage (1, 2 or 3); sets ``zero_optimization.stage`` (``None``: the config's).
        config: A DeepSpeed-style dict or JSON path. ``gradient_accumulation_steps``,
            ``gradient_clipping`` and the ``fp16`` / ``bf16`` sections come from the Trainer
            (``accumulate_grad_batches``, ``gradient_clip_val``, ``precision``) when left out
            or ``"auto"``; a value that disagrees with the Trainer is an error.
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
        process_group_backend, timeout: As for Lightning's ``DDPStrategy``.

    Attributes:
        engine: The :class:`zero_full.Engine` (``None`` before ``setup``).
    """

    strategy_name = "zero"
    _NO_ENGINE_YET = "the zero engine is built in ZeroStrategy.setup; nothing may train before it"

    # ------------------------------------------------------------------ configuration

    @property
    def handles_gradient_accumulation(self) -> bool:
        """The engine accumulates: every batch goes through ``optimizer_step``."""
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are read into the engine, so after ``setup`` built it."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer state is in zero's sharded checkpoint, read by :meth:`load_checkpoint`."""
        return False

    def zero_config(self, trainer: pl.Trainer) -> ZeroConfig:
        """The validated config of this run: the user's, completed from ``trainer``'s settings.

        Raises:
            ValueError: a config value disagrees with the Trainer, or clipping by value.
        """
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "Trainer(gradient_clip_algorithm='value') cannot run under zero: the engine clips the "
                "global gradient norm; use gradient_clip_algorithm='norm'"
            )
        raw = fill_from_trainer(
            load_raw(self._raw, None),
            accumulate=trainer.accumulate_grad_batches,
            clip_val=trainer.gradient_clip_val,
            precision_section=PRECISIONS[str(self.precision_plugin.precision)],
        )
        return ZeroConfig.model_validate(raw)

    def setup_environment(self) -> None:
        """Check and replace the precision plugin, then set up the process group (as DDP)."""
        plugin = self.precision_plugin
        flag = str(plugin.precision)
        if type(plugin) not in _PLUGINS or flag not in PRECISIONS:
            raise ValueError(
                f"Trainer(precision={flag!r}) with {type(plugin).__name__} cannot run under zero; zero "
                f"runs precision {', '.join(repr(p) for p in PRECISIONS)} (the engine keeps fp32 masters "
                "and trains in the bf16 / fp16 working dtype)"
            )
        if not isinstance(plugin, ZeroPrecision):
            self.precision_plugin = ZeroPrecision(flag, self._require_engine)
        super().setup_environment()

    def _module(self) -> pl.LightningModule:
        if self.lightning_module is None:
            raise RuntimeError("ZeroStrategy has no LightningModule: Trainer.fit / validate connects one")
        return self.lightning_module

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``zero_full.Init`` with this run's config: ``configure_model`` builds the model partitioned."""
        with Init(config=self.zero_config(self._module().trainer)):
            yield

    # ------------------------------------------------------------------ setup

    def setup(self, trainer: pl.Trainer) -> None:
        """Build the engine over the LightningModule (once; later ``validate`` / ``fit`` reuse it)."""
        if self.accelerator is not None:
            self.accelerator.setup(trainer)
        module = self._module()
        if self.engine is None:
            config = self.zero_config(trainer)
            if not any(zero_params.is_partitioned(p) for p in module.parameters()):
                self.model_to_device()
            optimizer, schedulers = _user_optimizer(module)
            self.engine = initialize(module, config=config, optimizer=optimizer)
            self.optimizers = [self.engine.optimizer.torch_optimizer]
            self.lr_scheduler_configs = schedulers
        self.model = module
        self.setup_precision_plugin()
        self.barrier()

    def teardown(self) -> None:
        """Lightning's teardown, except that the module and its optimizer state stay where they are.

        Their tensors are the engine's shards (a partitioned parameter refuses ``.cpu()``), and a
        later ``validate`` / ``fit`` reuses the engine.
        """
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Nothing: :meth:`setup` calls ``configure_optimizers`` and hands the optimizer to the engine."""

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the weights are in zero's sharded checkpoint (a whole state dict would gather the model)."""
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Empty: the optimizer state is in zero's sharded checkpoint."""
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write the directory ``filepath``: zero's sharded checkpoint and Lightning's state (collective).

        An existing ``filepath`` (``save_last`` overwriting ``last.ckpt``) is replaced.

        Raises:
            TypeError: ``storage_options`` (no ``CheckpointIO`` is used).
        """
        if storage_options is not None:
            raise TypeError("ZeroStrategy writes checkpoints itself: storage_options is not supported")
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero and path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.barrier("zero_checkpoint_cleared")
        self._require_engine().save_checkpoint(path, tag=CHECKPOINT_TAG)
        if self.is_global_zero:
            state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            torch.save(state, path / LIGHTNING_STATE)
        self.barrier("zero_checkpoint_saved")

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read zero's sharded checkpoint into the engine; return Lightning's state (collective).

        Raises:
            FileNotFoundError: ``checkpoint_path`` is not a directory written by this strategy.
        """
        path = Path(checkpoint_path)
        if not (path / CHECKPOINT_TAG).is_dir() or not (path / LIGHTNING_STATE).is_file():
            raise FileNotFoundError(
                f"{path} is not a checkpoint written by ZeroStrategy (a directory holding "
                f"{CHECKPOINT_TAG}/ and {LIGHTNING_STATE})"
            )
        self._require_engine().load_checkpoint(path, tag=CHECKPOINT_TAG)
        return torch.load(path / LIGHTNING_STATE, weights_only=False)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` restored the weights."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizer state."""


def _user_optimizer(module: pl.LightningModule) -> tuple[Any, list[Any]]:
    """The one optimizer and at most one scheduler of ``configure_optimizers``.

    Without ``configure_optimizers`` (``validate`` / ``predict`` only) the engine gets an
    SGD with learning rate 0, which never steps.

    Raises:
        ValueError: more than one optimizer or scheduler.
    """
    if not is_overridden("configure_optimizers", module):
        return (lambda params: torch.optim.SGD(params, lr=0.0)), []
    optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
    if len(optimizers) != 1 or len(schedulers) > 1:
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizer(s) and {len(schedulers)} "
            "scheduler(s); zero trains with one optimizer (and at most one LR scheduler): return one of each"
        )
    return optimizers[0], schedulers
