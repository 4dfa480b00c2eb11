"""The zero configuration: a DeepSpeed-style JSON dict, validated into one frozen object.

>>> cfg = ZeroConfig.model_validate({
...     "train_micro_batch_size_per_gpu": 4,
...     "gradient_accumulation_steps": 2,
...     "bf16": {"enabled": True},
...     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7},
... })
>>> cfg.precision, cfg.stage, cfg.zero_optimization.prefetch_bucket_size
(<Precision.BF16: 'bf16'>, 3, 50000000)
>>> cfg.resolve_batch(world_size=2).train_batch_size
16

Keys and defaults follow DeepSpeed. Differences a DeepSpeed user may meet:

* Unknown keys are errors (naming the full key path and the closest valid name), where
  DeepSpeed ignores most of them.
* ``"auto"`` values (Hugging Face Trainer configs) are errors naming the key: resolve
  them before passing the config.
* Features that are accepted and validated but not implemented yet are listed by
  :meth:`ZeroConfig.unsupported_features`; the engine refuses to run with any of them.
* Keys that the chosen stage or mode does not use are listed by
  :meth:`ZeroConfig.ignored_keys` (DeepSpeed ignores them silently).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from zero_full.config_sections import (
    AdamParams,
    BF16Config,
    Flag,
    FP16Config,
    OffloadDevice,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    OptimizerType,
    RobustnessConfig,
    SGDParams,
    ZeroOptimizationConfig,
    _int,
    _real,
    _Section,
)

__all__ = [
    "AdamParams",
    "BF16Config",
    "BatchSizes",
    "ConfigFileError",
    "FP16Config",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "OptimizerType",
    "Precision",
    "SGDParams",
    "ZeroConfig",
    "ZeroOptimizationConfig",
]


class Precision(str, enum.Enum):
    """Training precision chosen by the ``fp16`` / ``bf16`` sections (neither: fp32)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """The three batch numbers, consistent for one world size.

    ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.
    """

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int


class ConfigFileError(ValueError):
    """A config file that cannot be read as a JSON object (the message names path, line and column)."""


_MONITORING = (
    "monitoring is not configured through zero; use torch.profiler (zero marks its phases with "
    "record_function('zero.<phase>'))"
)

_TOP_HINTS: dict[str, str] = {
    "scheduler": "zero does not build learning-rate schedulers; create a torch.optim.lr_scheduler "
    "over engine.optimizer.torch_optimizer and step it yourself",
    "amp": 'Apex AMP is not supported; use "fp16" or "bf16"',
    "activation_checkpointing": "not configured through zero; use torch.utils.checkpoint in the model",
    "zero_allow_untested_optimizer": 'zero takes the optimizer from the "optimizer" section or from '
    "initialize(optimizer=...); remove the key",
    "communication_data_type": "not supported: gradients are reduced in their working precision",
    "prescale_gradients": "not supported: gradients are averaged over the data-parallel ranks",
    "gradient_predivide_factor": "not supported: gradients are averaged over the data-parallel ranks",
    "flops_profiler": _MONITORING,
    "tensorboard": _MONITORING,
    "wandb": _MONITORING,
    "csv_monitor": _MONITORING,
    "comms_logger": _MONITORING,
}

_DYNAMIC_SCALE_KEYS = (
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)


class ZeroConfig(_Section):
    """The whole zero configuration, as passed to ``zero_full.initialize(model, config=cfg)``.

    Build it with :meth:`model_validate` (a DeepSpeed-style dict), :meth:`from_json` (a
    file) or :meth:`coerce` (either, or an existing config). Every section is frozen.

    Attributes:
        train_batch_size: Global batch per optimizer step (``None``: derived).
        train_micro_batch_size_per_gpu: Batch per rank per forward/backward (``None``: derived).
        gradient_accumulation_steps: Micro-batches per optimizer step (``None``: derived).
        gradient_clipping: Maximum global gradient norm; 0 disables clipping.
        steps_per_print: Accepted for DeepSpeed compatibility (default 10); the engine prints
            no periodic progress line yet, so it has no effect and :meth:`ignored_keys` lists
            it when given.
        wall_clock_breakdown: Accepted for DeepSpeed compatibility and has no effect: zero
            marks every phase with ``torch.profiler.record_function("zero.<phase>")``, so a
            ``torch.profiler`` trace gives the breakdown. Listed by :meth:`ignored_keys` when true.
        fp16: Half precision and loss scaling.
        bf16: bfloat16 precision (also spelled ``bfloat16``, DeepSpeed's older name).
        optimizer: The optimizer to build, or ``None`` when ``initialize`` receives one.
        zero_optimization: The ZeRO stage and its knobs.
        robustness: Collective watchdog, non-finite gradient policy, rank agreement (not a
            DeepSpeed section).
    """

    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"bf16": ("bf16", "bfloat16")}
    _HINTS: ClassVar[dict[str, str]] = _TOP_HINTS

    train_batch_size: _int(1, none_ok=True) = None
    train_micro_batch_size_per_gpu: _int(1, none_ok=True) = None
    gradient_accumulation_steps: _int(1, none_ok=True) = None
    gradient_clipping: _real(0) = 0.0
    steps_per_print: _int(1) = 10
    wall_clock_breakdown: Flag = False
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig)
    robustness: RobustnessConfig = Field(default_factory=RobustnessConfig)

    @model_validator(mode="after")
    def _one_precision(self) -> ZeroConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true: enable one of them")
        return self

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ZeroConfig:
        """Load and validate a DeepSpeed-style JSON config file.

        Args:
            path: The file.

        Returns:
            The validated config.

        Raises:
            FileNotFoundError: no such file (the message names the path).
            ConfigFileError: not valid JSON (path, line and column), a key repeated in one
                object, or a top level that is not an object.
            pydantic.ValidationError: invalid content; the title names the file.
        """
        path = pathlib.Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"zero config file not found: {str(path)!r}") from None
        except IsADirectoryError:
            raise ConfigFileError(f"zero config path {str(path)!r} is a directory, not a JSON file") from None
        except UnicodeDecodeError as exc:
            raise ConfigFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        try:
            data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise ConfigFileError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
        except _DuplicateKey as exc:
            raise ConfigFileError(f"{path}: key {exc.args[0]!r} appears twice in one JSON object") from None
        if not isinstance(data, dict):
            raise ConfigFileError(f"{path}: the top level must be a JSON object, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _retitled(exc, f"ZeroConfig from {path}") from None

    @classmethod
    def coerce(cls, config: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> ZeroConfig:
        """Turn what a user passes as ``config=`` into a :class:`ZeroConfig`.

        Args:
            config: A ``ZeroConfig`` (returned as is), a DeepSpeed-style mapping, a path to a
                JSON file, or ``None`` (every default: stage 0, fp32).

        Raises:
            TypeError: anything else.
        """
        if config is None:
            return cls()
        if isinstance(config, ZeroConfig):
            return config
        if isinstance(config, Mapping):
            return cls.model_validate(dict(config))
        if isinstance(config, str | os.PathLike):
            return cls.from_json(config)
        raise TypeError(
            f"config must be a ZeroConfig, a dict or a path to a JSON file, got {type(config).__name__}"
        )

    # ------------------------------------------------------------------ accessors

    @property
    def precision(self) -> Precision:
        """FP16 or BF16 when that section is enabled, else FP32."""
        if self.fp16.enabled:
            return Precision.FP16
        if self.bf16.enabled:
            return Precision.BF16
        return Precision.FP32

    @property
    def stage(self) -> int:
        """The ZeRO stage (``zero_optimization.stage``)."""
        return self.zero_optimization.stage

    def resolve_batch(self, world_size: int) -> BatchSizes:
        """Fill in the batch numbers that are not given, DeepSpeed's way, for ``world_size`` ranks.

        * all three given: they must satisfy ``train = micro * accumulation * world``;
        * two given: the third is derived and must come out whole;
        * only ``train_batch_size`` or only the micro batch: accumulation is 1.

        Args:
            world_size: Number of data-parallel ranks.

        Returns:
            The three consistent numbers.

        Raises:
            ValueError: the numbers are inconsistent or do not divide (the message names the
                three numbers and the world size), or neither the global nor the micro
                batch size is given.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"resolve_batch: world_size must be an integer >= 1, got {world_size!r}")
        train, micro, accum = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        given = (
            f"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
            f"gradient_accumulation_steps={accum}, world_size={world_size}"
        )
        if train is None and micro is None:
            raise ValueError(
                f"batch size unknown ({given}): give train_batch_size or train_micro_batch_size_per_gpu"
            )
        if micro is not None and accum is not None:
            product = micro * accum * world_size
            if train is not None and train != product:
                raise ValueError(
                    f"inconsistent batch sizes ({given}): with world size {world_size}, micro-batch {micro} "
                    f"and gradient accumulation {accum}, train_batch_size must be {micro} * {accum} * "
                    f"{world_size} = {product}; or drop one of the three and it is derived"
                )
            return BatchSizes(product, micro, accum, world_size)
        if train is None:  # micro only
            return BatchSizes(micro * world_size, micro, 1, world_size)
        if micro is None and accum is None:  # train only
            accum = 1
        if micro is None:
            micro, rest = divmod(train, accum * world_size)
            step, fixed = accum * world_size, f"gradient accumulation {accum}"
        else:
            accum, rest = divmod(train, micro * world_size)
            step, fixed = micro * world_size, f"micro-batch {micro}"
        if rest or micro == 0 or accum == 0:
            raise ValueError(
                f"inconsistent batch sizes ({given}): {_batch_hint(train, world_size, step, fixed)}"
            )
        return BatchSizes(train, micro, accum, world_size)

    def unsupported_features(self) -> list[str]:
        """Features this config requests that zero accepts but does not implement yet.

        A feature is listed only when the chosen stage would use it (a stage-3 knob under
        stage 2 is in :meth:`ignored_keys` instead). The engine refuses to start when this
        list is not empty; nothing is silently dropped.

        Returns:
            One line per feature: the key, its value and what it is.
        """
        z = self.zero_optimization
        found: list[str] = []
        if not z.load_from_fp32_weights:
            found.append(
                "zero_optimization.load_from_fp32_weights = false (master weights from 16-bit copies)"
            )
        if not z.ignore_unused_parameters:
            found.append("zero_optimization.ignore_unused_parameters = false (error on unused parameters)")
        if self.fp16.enabled and self.fp16.auto_cast:
            found.append("fp16.auto_cast = true (casting inputs to fp16)")
        if self.optimizer is not None and isinstance(self.optimizer.params, AdamParams):
            if not self.optimizer.params.bias_correction:
                found.append("optimizer.params.bias_correction = false (Adam without bias correction)")
        return found

    def ignored_keys(self) -> list[str]:
        """Full paths of keys that were given but have no effect with this config.

        Stage-3 knobs under stage 1/2, stage-1/2 knobs under stage 3, ``offload_optimizer``
        under stage 0, ``nvme_path`` without the nvme device, ``fp16`` settings while fp16
        is off, dynamic-scaling settings with a static ``loss_scale``, ``adam_w_mode`` on
        ``AdamW``, ``torch_adam``, ``steps_per_print`` and ``wall_clock_breakdown = true``.
        DeepSpeed accepts them too; the engine logs this list once.
        """
        ignored = self.zero_optimization.ignored_keys()
        fp16_given = [k for k in self.fp16.given_keys() if k != "enabled"]
        if not self.fp16.enabled:
            ignored += [f"fp16.{k}" for k in fp16_given]
        elif not self.fp16.dynamic_loss_scale:
            ignored += [f"fp16.{k}" for k in fp16_given if k in _DYNAMIC_SCALE_KEYS]
        if self.optimizer is not None and isinstance(self.optimizer.params, AdamParams):
            given = self.optimizer.params.given_keys()
            if "adam_w_mode" in given and self.optimizer.type is OptimizerType.ADAMW:
                ignored.append("optimizer.params.adam_w_mode")
            if "torch_adam" in given:
                ignored.append("optimizer.params.torch_adam")
        if "steps_per_print" in self.model_fields_set:
            ignored.append("steps_per_print")
        if self.wall_clock_breakdown:
            ignored.append("wall_clock_breakdown")
        return ignored


class _DuplicateKey(Exception):
    pass


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _retitled(exc: ValidationError, title: str) -> ValidationError:
    """The same errors (type, location, message) under another title."""
    details = [
        InitErrorDetails(
            type=PydanticCustomError(err["type"], err["msg"], None), loc=err["loc"], input=err["input"]
        )
        for err in exc.errors()
    ]
    return ValidationError.from_exception_data(title, details, hide_input=True)


def _batch_hint(train: int, world_size: int, step: int, fixed: str) -> str:
    """Which ``train_batch_size`` values work: the multiples of ``step`` (= fixed size x world size)."""
    lower = max(step, train // step * step)
    near = sorted({lower, lower + step} - {train})
    values = " or ".join(str(v) for v in near)
    return (
        f"with world size {world_size} and {fixed}, train_batch_size must be a multiple of {step} "
        f"(e.g. {values}), got {train}"
    )
