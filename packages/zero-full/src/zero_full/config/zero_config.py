"""The zero configuration: a DeepSpeed-style JSON dict, validated into one frozen object.

Keys and defaults follow DeepSpeed. Unlike DeepSpeed, unknown keys and ``"auto"`` values are
errors naming the key; features accepted but not implemented are listed by
:meth:`ZeroConfig.unsupported_features` (the engine refuses them) and keys without effect by
:meth:`ZeroConfig.ignored_keys`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from zero_full.config.base import KeyReport, Section, key_report
from zero_full.config.monitoring import (
    CometConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zero_full.config.optimizer import AdamParams, OptimizerConfig, OptimizerType, SGDParams
from zero_full.config.precision import BF16Config, FP16Config
from zero_full.config.robustness import RobustnessConfig
from zero_full.config.scheduler import SchedulerConfig
from zero_full.config.types import USED, Choice, Flag, Ignored, Int, Key, Real, Rejected
from zero_full.config.zero_optimization import (
    OffloadDevice,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroOptimizationConfig,
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


_AVERAGED = Rejected("not supported: gradients are averaged over the data-parallel ranks")

_TOP_REJECTED: dict[str, Rejected] = {
    "amp": Rejected('Apex AMP is not supported; use "fp16" or "bf16"'),
    "activation_checkpointing": Rejected(
        "not configured through zero; use torch.utils.checkpoint in the model"
    ),
    "zero_allow_untested_optimizer": Rejected(
        'zero takes the optimizer from the "optimizer" section or from initialize(optimizer=...); '
        "remove the key"
    ),
    "prescale_gradients": _AVERAGED,
    "gradient_predivide_factor": _AVERAGED,
}
_CommDtype = Choice(Precision)


class ZeroConfig(Section):
    """The whole zero configuration, as passed to ``zero_full.initialize(model, config=cfg)``.

    Build it with :meth:`model_validate` (a DeepSpeed-style dict), :meth:`from_json` (a
    file) or :meth:`coerce` (either, or an existing config). Every section is frozen.
    """

    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"bf16": ("bf16", "bfloat16")}
    _REJECTED: ClassVar[dict[str, Rejected]] = _TOP_REJECTED

    train_batch_size: Annotated[Int(1, none_ok=True), USED] = None
    """Global batch per optimizer step (``null``: derived, see *Batch sizes*)."""
    train_micro_batch_size_per_gpu: Annotated[Int(1, none_ok=True), USED] = None
    """Batch per rank per forward/backward (``null``: derived)."""
    gradient_accumulation_steps: Annotated[Int(1, none_ok=True), USED] = None
    """Micro-batches per optimizer step (``null``: derived)."""
    gradient_clipping: Annotated[Real(0), USED] = 0.0
    """Maximum global gradient norm; 0 disables clipping."""
    steps_per_print: Annotated[Int(1), USED] = 10
    """Optimizer steps between two progress lines on rank 0: ``zero_full.deepspeed``'s engine prints
    DeepSpeed's line, zero's engine logs one at INFO (logger ``zero.monitor``)."""
    wall_clock_breakdown: Annotated[
        Flag,
        Key(
            Ignored(
                'zero marks every phase with `torch.profiler.record_function("zero.<phase>")`: a '
                "torch.profiler trace gives the breakdown",
                behaves_as=False,
            )
        ),
    ] = False
    """DeepSpeed: time the phases of each step and print them."""
    fp16: Annotated[FP16Config, USED] = Field(default_factory=FP16Config)
    """Half precision and loss scaling (section below)."""
    bf16: Annotated[BF16Config, USED] = Field(default_factory=BF16Config)
    """bfloat16 precision (section below; also spelled ``bfloat16``, DeepSpeed's older name)."""
    optimizer: Annotated[OptimizerConfig | None, USED] = None
    """The optimizer to build (section below), or ``null`` when ``initialize`` receives one."""
    scheduler: Annotated[SchedulerConfig | None, USED] = None
    """The learning-rate schedule to build over the optimizer (section below), or ``null``."""
    zero_optimization: Annotated[ZeroOptimizationConfig, USED] = Field(default_factory=ZeroOptimizationConfig)
    """The ZeRO stage and its knobs (section below)."""
    communication_data_type: Annotated[_CommDtype | None, USED] = None
    """The dtype gradients are reduced in (every stage) and, when it is narrower than the working
    dtype, stage-3 parameters are gathered in: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``null``: the
    working dtype). Reductions sum and average in the working dtype after the cast back (no
    prescaling); fp32 training with ``"bf16"`` halves the bytes. Not with ``mics_shard_size``
    (see the Precision page of the docs)."""
    tensorboard: Annotated[TensorBoardConfig, USED] = Field(default_factory=TensorBoardConfig)
    """TensorBoard events of each optimizer step (section below)."""
    wandb: Annotated[WandbConfig, USED] = Field(default_factory=WandbConfig)
    """Weights & Biases logging of each optimizer step (section below)."""
    comet: Annotated[CometConfig, USED] = Field(default_factory=CometConfig)
    """Comet logging of each optimizer step (section below)."""
    csv_monitor: Annotated[CsvMonitorConfig, USED] = Field(default_factory=CsvMonitorConfig)
    """CSV files of each optimizer step's events (section below)."""
    comms_logger: Annotated[CommsLoggerConfig, USED] = Field(default_factory=CommsLoggerConfig)
    """A table of the engine's collectives (section below)."""
    flops_profiler: Annotated[FlopsProfilerConfig, USED] = Field(default_factory=FlopsProfilerConfig)
    """The forward's FLOPs at one step (section below)."""
    robustness: Annotated[RobustnessConfig, USED] = Field(default_factory=RobustnessConfig)
    """Collective watchdog, non-finite gradient policy, rank agreement (section below; not a
    DeepSpeed section)."""

    @model_validator(mode="after")
    def _one_precision(self) -> ZeroConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true: enable one of them")
        return self

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ZeroConfig:
        """Load and validate a DeepSpeed-style JSON config file.

        Errors name the file: :class:`ConfigFileError` for invalid JSON (line and column) or a
        repeated key, ``pydantic.ValidationError`` for invalid content.
        """
        path = pathlib.Path(path)
        data = cls.read_json(path)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _retitled(exc, f"ZeroConfig from {path}") from None

    @staticmethod
    def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The JSON object of a config file, not validated (errors as :meth:`from_json` says)."""
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
        return data

    @classmethod
    def coerce(cls, config: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> ZeroConfig:
        """Turn what a user passes as ``config=`` into a :class:`ZeroConfig`.

        Takes a ``ZeroConfig`` (returned as is), a mapping, a JSON file path, or ``None`` (every
        default: stage 0, fp32); anything else is a ``TypeError``.
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

    def key_report(self) -> KeyReport:
        """The keys given that have no effect, and the values zero refuses, each with its reason.

        Derived from the :class:`~zero_full.config.types.Key` each field declares (see
        :func:`zero_full.config.base.key_report`).
        """
        return key_report(self, self.stage)

    def unsupported_features(self) -> list[str]:
        """Features this config requests that zero accepts but does not implement yet.

        These are the values of keys declared :class:`~zero_full.config.types.Refused`, listed
        only when the chosen stage would use the key (a stage-3 knob under stage 2 is in
        :meth:`ignored_keys` instead). The engine refuses to start when this list is not
        empty; nothing is silently dropped.
        """
        found = [f"{f.path} = {f.value_text()} ({f.reason})" for f in self.key_report().refused]
        z = self.zero_optimization
        if self.communication_data_type is not None and z.stage == 3 and z.mics_enabled:
            found.append(
                f"communication_data_type = {self.communication_data_type.value!r} with "
                "zero_optimization.mics_shard_size (cast collectives over MiCS groups)"
            )
        if self.communication_data_type is not None and z.zeropp_enabled:
            if z.zero_quantized_weights or z.zero_quantized_gradients:
                found.append(
                    f"communication_data_type = {self.communication_data_type.value!r} with ZeRO++ "
                    "quantization (zero_quantized_weights / zero_quantized_gradients choose the wire "
                    "format themselves: use one or the other)"
                )
        return found

    def ignored_keys(self) -> list[str]:
        """Full paths of keys that were given but have no effect with this config."""
        return [f.path for f in self.key_report().ignored]


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
