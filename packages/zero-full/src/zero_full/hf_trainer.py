"""``ZeroTrainer``: the Hugging Face ``Trainer`` training with zero (one-line change for a Trainer user).

``ZeroTrainer(model=..., args=TrainingArguments(...), ..., zero_config=ds_style_dict)`` in place
of ``Trainer(...)``. Lifecycle:

1. ``__init__``: the config's ``"auto"`` values are filled from ``TrainingArguments``
   (:mod:`zero_full.hf.auto`) and validated; settings zero cannot honour are refused here.
2. ``create_optimizer`` (the Trainer calls it when training starts): the Trainer's own
   optimizer (``optim``, weight-decay groups) or the config's ``optimizer`` section, and
   ``zero_full.initialize`` over the model. The Trainer then sees a step-only optimizer
   whose ``param_groups`` are the engine's, so its LR scheduler sets the engine's rate,
   and a wrapper module (Accelerate leaves it unwrapped: no DDP around the engine).
3. ``training_step``: forward and loss as the Trainer computes them, ``engine.backward``;
   the optimizer step (at the accumulation boundary) is ``engine.step()``: reduction,
   ``gradient_clipping`` (from ``max_grad_norm``), the update. ``grad_norm`` in the logs is
   the engine's (``loss_scale`` too under fp16); ``learning_rate`` is the one the step used.
4. ``generate``: the engine's model with every parameter gathered once for the whole
   generation (:meth:`zero_full.Engine.gathered_for_inference`), not once per token.
5. ``save_model``: the Hugging Face layout through ``engine.save_pretrained``; a PEFT model
   (LoRA adapters on a frozen base) writes its adapter in the PEFT format instead, gathering
   the trainable parameters only.
6. Checkpoints (``save_strategy``): the model in the Hugging Face layout
   (``engine.save_pretrained``), zero's sharded checkpoint in ``zero_checkpoint/``, and the
   Trainer's scheduler, RNG and trainer state; ``train(resume_from_checkpoint=...)`` reads
   them back and the Trainer skips the data already seen.

Checkpoint saving and loading override the three Trainer methods its own DeepSpeed and FSDP
support use (``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``,
``_load_from_checkpoint``): a sharded save is collective, which no public hook allows.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import zero_params
from zero_full.config.zero_config import Precision, ZeroConfig
from zero_full.engine import Engine, initialize
from zero_full.hf.auto import fill_from_training_args

try:
    from transformers import Trainer
    from transformers.training_args import TrainingArguments
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "zero_full.hf_trainer needs transformers: pip install 'zero-full[transformers]'"
    ) from exc

__all__ = ["ZERO_CHECKPOINT", "ZeroTrainer"]

ZERO_CHECKPOINT = "zero_checkpoint"
"""Sub-directory of a Trainer checkpoint that holds zero's sharded checkpoint."""
_SCHEDULER = "scheduler.pt"
_TRAINING_ARGS = "training_args.bin"


class _EngineModule(nn.Module):
    """What the Trainer drives: ``forward`` is ``engine(...)``; the model is not a registered child.

    Not registering it keeps Accelerate from wrapping it (in DDP) and the Trainer's own
    clipping from touching gradients the engine owns.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        object.__setattr__(self, "engine", engine)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> _EngineModule:
        self.engine.train(mode)
        return super().train(mode)

    @property
    def config(self) -> Any:
        return getattr(self.engine.module, "config", None)


class _EngineStep(torch.optim.Optimizer):
    """The optimizer the Trainer sees: ``step()`` is ``engine.step()``; groups and state are the engine's.

    It holds no state of its own: ``state_dict()`` is empty (zero's checkpoint saves the
    optimizer). Not built by ``Optimizer.__init__``: the engine's torch optimizer owns the groups.
    """

    def __init__(self, engine: Engine) -> None:  # noqa: D107
        self._engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._engine.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._engine.optimizer.torch_optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._engine.optimizer.torch_optimizer.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("the zero engine's optimizer step takes no closure")
        self._engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes its gradient partitions at each step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict:
            raise ValueError(
                "the zero engine's optimizer state is restored from its sharded checkpoint "
                f"({ZERO_CHECKPOINT}/ of a Trainer checkpoint), not from a state dict"
            )


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` training with zero.

    Args:
        *args, **kwargs: As for ``transformers.Trainer``.
        zero_config: A DeepSpeed-style dict or JSON path (``"auto"`` values allowed, see
            :func:`zero_full.hf.auto.fill_from_training_args`).

    Attributes:
        zero_config: The validated :class:`zero_full.ZeroConfig`.
        engine: The :class:`zero_full.Engine` (``None`` until training or evaluation starts).

    Raises:
        ValueError: ``TrainingArguments(deepspeed=...)``, ``fsdp``, ``auto_find_batch_size`` or
            several GPUs per process (DataParallel); a config value that disagrees with
            ``TrainingArguments``.
    """

    def __init__(self, *args: Any, zero_config: Mapping[str, Any] | str | os.PathLike[str], **kwargs: Any):
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if isinstance(given, TrainingArguments):  # before the Trainer acts on them (fsdp, deepspeed)
            _refuse_unsupported(given)
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self.args)
        if self.model_init is not None:
            raise ValueError(
                "ZeroTrainer cannot take model_init: the engine shards the one model it is given; "
                "pass model=..."
            )
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None)
        raw = fill_from_training_args(zero_config, self.args, self.args.world_size, hidden)
        self.zero_config = ZeroConfig.model_validate(raw)
        self.engine: Engine | None = None

    # ------------------------------------------------------------------ engine

    def zero_engine(self) -> Engine:
        """The engine, built on first use over ``self.model`` with the Trainer's optimizer."""
        if self.engine is None:
            optimizer = None
            if self.zero_config.optimizer is None:
                optimizer = self.optimizer if self.optimizer is not None else super().create_optimizer()
            self.engine = initialize(self.model, config=self.zero_config, optimizer=optimizer)
            self.model_wrapped = _EngineModule(self.engine)
        return self.engine

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """Once the engine exists, the module the Trainer drives is its wrapper: Accelerate never
        prepares (moves or wraps) the engine's model, whose stage-3 parameters are shards."""
        if self.engine is not None:
            return self.model_wrapped
        return super()._wrap_model(model, training, dataloader)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The Trainer's ``model.to(device)``, except for a model built under ``zero_full.Init`` or
        loaded into shards: its parameters are partitioned placeholders, placed by the engine."""
        if any(zero_params.is_partitioned(p) for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the engine; the Trainer's optimizer is its step-only view."""
        self.optimizer = _EngineStep(self.zero_engine())
        return self.optimizer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; refuses an epoch whose batches the accumulation does not divide."""
        steps = len(self.get_train_dataloader())
        if steps % self.args.gradient_accumulation_steps:
            raise ValueError(
                f"{steps} batches per epoch on each rank is not a multiple of gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps}: the engine steps every "
                f"{self.args.gradient_accumulation_steps} micro-batches; change the batch size, the data "
                "or dataloader_drop_last"
            )
        return super().train(*args, **kwargs)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The Trainer's loss, ``engine.backward``, and the micro-step count (the step is the optimizer's)."""
        engine = self.zero_engine()
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # the loss is already normalised for accumulation; the engine divides by it again
        engine.backward(loss * engine.gradient_accumulation_steps)
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # counts the micro-step; the boundary step is the optimizer's step()
        return loss.detach()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log line with the engine's ``grad_norm`` (and fp16 ``loss_scale``)."""
        if self.engine is not None and "grad_norm" in logs:
            norm = self.engine.grad_norm
            if norm is None:
                del logs["grad_norm"]  # not measured (gradient_clipping 0)
            else:
                logs["grad_norm"] = norm
            if self.engine.config.precision is Precision.FP16:
                logs["loss_scale"] = self.engine.stats.loss_scale
        super().log(logs, start_time)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` on the engine's model (stage 3: gathered module by module)."""
        self.zero_engine()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict`` on the engine's model."""
        self.zero_engine()
        return super().predict(*args, **kwargs)

    def generate(self, *args: Any, budget_bytes: int | None = None, **kwargs: Any) -> Any:
        """``model.generate(...)`` with the parameters gathered once for the whole generation.

        Collective: every rank calls it (with its own inputs). ``budget_bytes``: see
        :meth:`zero_full.Engine.gathered_for_inference`.
        """
        engine = self.zero_engine()
        was_training = engine.module.training
        engine.eval()
        try:
            with engine.gathered_for_inference(budget_bytes):
                return engine.module.generate(*args, **kwargs)
        finally:
            engine.train(was_training)

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model in the Hugging Face layout through ``engine.save_pretrained`` (collective)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _is_peft_model(self.engine.module):
            # the adapter: only the trainable parameters are gathered (collective; rank 0 holds
            # them), the frozen base never is
            module = self.engine.module
            trainable = [name for name, p in module.named_parameters() if p.requires_grad]
            state = self.engine.consolidated_state_dict(params=trainable)
            if self.args.process_index == 0:
                self.engine.module.save_pretrained(output_dir, state_dict=state)
        else:
            self.engine.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        stale = os.path.join(output_dir, ZERO_CHECKPOINT)
        if self.args.should_save and os.path.isdir(stale):  # the Trainer overwrites checkpoint-N too
            shutil.rmtree(stale)
        self.accelerator.wait_for_everyone()
        self.zero_engine().save_checkpoint(output_dir, tag=ZERO_CHECKPOINT)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.zero_engine().load_checkpoint(checkpoint, tag=ZERO_CHECKPOINT)
        state = torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True)
        self.lr_scheduler.load_state_dict(state)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_CHECKPOINT)):
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no {ZERO_CHECKPOINT}/: resume_from_checkpoint needs a "
                "checkpoint written by ZeroTrainer"
            )
        # the weights are read with the optimizer state from zero's checkpoint


def _is_peft_model(module: nn.Module) -> bool:
    """A ``peft.PeftModel`` (its ``save_pretrained`` writes the adapter only); peft is not imported:
    a model of that class exists only where peft is installed."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(module).__mro__)


def _refuse_unsupported(args: TrainingArguments) -> None:
    """Trainer settings that would put a second engine around the model, or cannot be honoured."""
    problems = []
    if args.deepspeed:
        problems.append("deepspeed=... (pass the DeepSpeed config as ZeroTrainer(zero_config=...))")
    if args.fsdp:
        problems.append("fsdp=... (zero shards the model itself)")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size=True (the engine is built for one batch size)")
    if args.n_gpu > 1:
        problems.append(f"{args.n_gpu} GPUs in one process (launch one process per GPU with torchrun)")
    if problems:
        raise ValueError("ZeroTrainer cannot run with TrainingArguments " + "; ".join(problems))
