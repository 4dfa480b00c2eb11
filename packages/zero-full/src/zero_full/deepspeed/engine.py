"""``DeepSpeedEngine``: zero's :class:`~zero_full.Engine` under DeepSpeed's member names."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero_full.checkpoint import io as ckpt_io
from zero_full.checkpoint import read_client_state
from zero_full.config.zero_config import Precision, ZeroConfig
from zero_full.deepspeed.accelerator import get_accelerator
from zero_full.engine import Engine
from zero_optim import PartitionedOptimizer

__all__ = ["DeepSpeedEngine"]

logger = logging.getLogger("zero.deepspeed")

_ZERO_WAY: dict[str, str] = {
    "save_16bit_model": "engine.zero_engine.save_pretrained(directory) writes the weights (safetensors)",
    "save_fp16_model": "engine.zero_engine.save_pretrained(directory) writes the weights (safetensors)",
    "module_state_dict": "engine.zero_engine.consolidated_state_dict() gathers the full weights on rank 0",
    "get_fp32_state_dict": "engine.zero_engine.consolidated_state_dict() gathers the full weights on rank 0",
    "train_batch": "pipeline parallelism is not in zero: loop over forward, backward and step",
    "eval_batch": "pipeline parallelism is not in zero: call the engine under torch.no_grad()",
    "set_train_batch_size": "set train_batch_size in the config before initialize()",
    "set_gradient_accumulation_boundary": "zero counts micro-steps itself (gradient_accumulation_steps)",
    "empty_partition_cache": "zero releases gathered parameters after each use; nothing to empty",
}


class DeepSpeedEngine:
    """A model trained by zero, reached with DeepSpeed's member names."""

    def __init__(self, engine: Engine, training_dataloader: Any = None) -> None:
        self.zero_engine = engine
        self.training_dataloader = training_dataloader

    def __repr__(self) -> str:
        return f"DeepSpeedEngine({self.zero_engine!r})"

    def __getattr__(self, name: str) -> Any:
        way = _ZERO_WAY.get(name)
        if way is not None:
            raise AttributeError(f"DeepSpeedEngine.{name} is not available in zero: {way}")
        raise AttributeError(
            f"DeepSpeedEngine has no attribute {name!r} (zero's own engine is engine.zero_engine)"
        )

    # ------------------------------------------------------------------ model and step

    @property
    def module(self) -> nn.Module:
        """The model."""
        return self.zero_engine.module

    @property
    def optimizer(self) -> PartitionedOptimizer:
        """The partitioned optimizer (``param_groups`` are the torch optimizer's)."""
        return self.zero_engine.optimizer

    @property
    def config(self) -> ZeroConfig:
        """The validated configuration."""
        return self.zero_engine.config

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler stepped after each applied optimizer step (``None`` without one)."""
        return self.zero_engine.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self.zero_engine.lr_scheduler = scheduler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward."""
        return self.zero_engine(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (as calling the engine)."""
        return self.zero_engine(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of ``loss`` (scaled by ``1 / gradient_accumulation_steps``, as DeepSpeed).

        Raises:
            ValueError: ``retain_graph`` or ``scale_wrt_gas=False`` (zero always scales and
                frees the graph).
        """
        if retain_graph or not scale_wrt_gas:
            raise ValueError(
                "engine.backward: retain_graph=True / scale_wrt_gas=False are not supported by zero; "
                "call engine.backward(loss) (the loss is divided by gradient_accumulation_steps)"
            )
        return self.zero_engine.backward(loss)

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """End a micro-step; at the boundary step the optimizer, the LR scheduler, print progress.

        Raises:
            ValueError: ``lr_kwargs`` (zero steps the scheduler without arguments; step it
                yourself after ``engine.step()`` and leave ``engine.lr_scheduler`` unset).
        """
        if lr_kwargs:
            raise ValueError(
                "engine.step(lr_kwargs=...) is not supported by zero: set engine.lr_scheduler = None "
                "and call scheduler.step(**kwargs) yourself after engine.step()"
            )
        boundary = self.is_gradient_accumulation_boundary()
        self.zero_engine.step()
        every = self.config.steps_per_print
        if boundary and every and self.global_steps % every == 0 and self.global_rank == 0:
            self._report_progress()

    def _report_progress(self) -> None:
        """DeepSpeed's progress line (rank 0): step, skipped steps, lr, momentum, loss scale."""
        print(
            f"[Rank 0] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
            f"mom={self.get_mom()}, loss_scale={self.zero_engine.stats.loss_scale}",
            flush=True,
        )

    def zero_grad(self) -> None:
        """Zero the gradients (the engine's step zeroes them already; this is for early exits)."""
        self.zero_engine.optimizer.zero_grad()
        for p in self.module.parameters():
            p.grad = None

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        """``module.train(mode)``."""
        self.zero_engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        """``module.eval()``."""
        self.zero_engine.eval()
        return self

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters."""
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's named parameters."""
        return self.module.named_parameters(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming ``step()`` runs the optimizer."""
        return self.zero_engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (``False`` when it was skipped)."""
        return self.zero_engine.last_step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (``None`` without ``gradient_clipping``)."""
        return self.zero_engine.grad_norm

    # ------------------------------------------------------------------ ranks and devices

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        """This process's rank."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """The number of data-parallel processes."""
        return dist.get_world_size()

    @property
    def dp_world_size(self) -> int:
        """The number of data-parallel processes (all of them: zero is data-parallel only)."""
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:
        """This process's device (``cpu`` without an accelerator, else ``<type>:<local_rank>``)."""
        return torch.device(get_accelerator().device_name(self.local_rank))

    # ------------------------------------------------------------------ config accessors

    def _batch(self) -> Any:
        try:
            return self.config.resolve_batch(dist.get_world_size())
        except ValueError as exc:
            raise ValueError(f"the config does not set the batch size: {exc}") from None

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self._batch().train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward."""
        return self._batch().train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.zero_engine.gradient_accumulation_steps

    def bfloat16_enabled(self) -> bool:
        """Whether the ``bf16`` section is enabled."""
        return self.config.precision is Precision.BF16

    def fp16_enabled(self) -> bool:
        """Whether the ``fp16`` section is enabled."""
        return self.config.precision is Precision.FP16

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage."""
        return self.config.stage

    def gradient_clipping(self) -> float:
        """The clipping norm (0: none)."""
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int:
        """Optimizer steps between progress lines."""
        return int(self.config.steps_per_print)

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each group's momentum: Adam's ``betas``, SGD's ``momentum``."""
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ counters

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped ones included, as DeepSpeed counts them)."""
        return self.zero_engine.global_steps

    @property
    def micro_steps(self) -> int:
        """``step()`` calls so far."""
        return self.zero_engine.micro_steps

    @property
    def global_samples(self) -> int:
        """Samples consumed over all ranks: ``global_steps * train_batch_size()``."""
        return self.global_steps * self.train_batch_size()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf / nan gradients."""
        return self.zero_engine.stats.skipped_steps

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        overwrite: bool = True,
    ) -> bool:
        """Save to ``save_dir/tag`` (default ``global_step{N}``); an existing tag is replaced atomically.

        ``overwrite=False`` refuses an existing tag instead. Collective: every rank. Returns
        ``True`` (as DeepSpeed).
        """
        self.zero_engine.save_checkpoint(
            save_dir,
            tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
            overwrite=overwrite,
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Restore from ``load_dir/tag`` (``None``: ``latest``'s tag); returns ``(path, client_state)``.

        Without a tag and without ``load_dir/latest`` nothing is loaded and ``(None, None)``
        is returned, as DeepSpeed does. Collective: every rank.
        """
        if custom_load_fn is not None:
            raise ValueError(
                "load_checkpoint(custom_load_fn=...) is not supported by zero; load weights with "
                "engine.zero_engine.load_pretrained(path) or zero_full.checkpoint functions"
            )
        load_dir = Path(load_dir)
        if tag is None and not (load_dir / ckpt_io.LATEST).is_file():
            if dist.get_rank() == 0:
                logger.warning(
                    "zero: no checkpoint loaded: %s does not exist; pass tag=... to load a given one",
                    load_dir / ckpt_io.LATEST,
                )
            return None, None
        path = self.zero_engine.load_checkpoint(
            load_dir,
            tag,
            strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        return str(path), read_client_state(path.parent, path.name)
