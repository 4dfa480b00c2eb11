"""Sections of the zero configuration (``fp16``, ``bf16``, ``optimizer``, ``zero_optimization``).

Every section is a frozen pydantic model with ``extra="forbid"``. The key check runs
before pydantic's own validation: an unknown key is reported with its full DeepSpeed
path (``zero_optimization.stage3_prefetch_bucket_sz``) and the closest accepted name,
a value of ``"auto"`` (Hugging Face Trainer configs) is reported by key, and two
spellings of one knob (``stage3_prefetch_bucket_size`` / ``prefetch_bucket_size``)
with different values are a conflict. Scalars are checked by the small validators
below, whose messages name the accepted range.

:class:`zero_full.config.ZeroConfig` assembles these sections; use it rather than the
sections on their own.
"""

from __future__ import annotations

import difflib
import enum
import functools
import math
import pathlib
import sys
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

if typing.TYPE_CHECKING:  # the lower packages are imported only when a mapping is asked for
    from zero_comm.qgz_feedback import ErrorFeedbackConfig
    from zero_coord import CoordinatorConfig
    from zero_offload import OptimizerOffloadConfig, ParamOffloadConfig
    from zero_optim.buckets import ReduceConfig

__all__ = [
    "AdamParams",
    "BF16Config",
    "FP16Config",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "NonFinitePolicy",
    "OptimizerType",
    "RobustnessConfig",
    "SGDParams",
    "ZeroOptimizationConfig",
]


# --------------------------------------------------------------------------- scalar checks


def _describe_range(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi:g}"
    return ""


def _check_int(value: Any, lo: int | None, hi: int | None, none_ok: bool = False) -> int | None:
    """A whole number: an int, or a float without fraction (DeepSpeed configs write ``5e8``)."""
    if value is None and none_ok:
        return None
    rng = _describe_range(lo, hi)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("whole_number", f"expected a whole number{rng}, got {value!r}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise PydanticCustomError("whole_number", f"expected a whole number{rng}, got {value!r}")
        value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise PydanticCustomError("out_of_range", f"expected a whole number{rng}, got {value}")
    return value


def _check_real(value: Any, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> float:
    rng = _describe_range(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PydanticCustomError("number", f"expected a number{rng}, got {value!r}")
    value = float(value)
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and (value >= hi if hi_open else value > hi)
    if too_low or too_high:
        raise PydanticCustomError("out_of_range", f"expected a number{rng}, got {value:g}")
    return value


def _check_flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise PydanticCustomError("boolean", f"expected true or false, got {value!r}")
    return value


def _check_path(value: Any) -> pathlib.Path | None:
    if value is None:
        return None
    if not isinstance(value, str | pathlib.PurePath) or not str(value):
        raise PydanticCustomError("path", f"expected a non-empty path string, got {value!r}")
    return pathlib.Path(value)


def _int(lo: int | None = None, hi: int | None = None, *, none_ok: bool = False) -> Any:
    """``int`` annotation accepting whole numbers in ``[lo, hi]`` (and ``None`` if ``none_ok``)."""
    check = BeforeValidator(functools.partial(_check_int, lo=lo, hi=hi, none_ok=none_ok))
    return Annotated[int | None, check] if none_ok else Annotated[int, check]


def _real(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Any:
    """``float`` annotation accepting finite numbers in the given range."""
    check = functools.partial(_check_real, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open)
    return Annotated[float, BeforeValidator(check)]


Flag = Annotated[bool, BeforeValidator(_check_flag)]
OptionalPath = Annotated[pathlib.Path | None, BeforeValidator(_check_path)]


def _choice(enum_cls: type[enum.Enum], value: Any) -> enum.Enum:
    """Parse an enum member from its value, case-insensitively, naming the accepted values."""
    if isinstance(value, enum_cls):
        return value
    names = [m.value for m in enum_cls]
    if isinstance(value, str):
        for member in enum_cls:
            if member.value.lower() == value.lower():
                return member
    accepted = ", ".join(repr(n) for n in names)
    close = difflib.get_close_matches(str(value), names, n=1) if isinstance(value, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise PydanticCustomError("choice", f"expected one of {accepted} (any case), got {value!r}{hint}")


class OffloadDevice(str, enum.Enum):
    """Where offloaded state lives (DeepSpeed's ``offload_*.device``)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class OptimizerType(str, enum.Enum):
    """Optimizers the ``optimizer`` section can describe (``type`` is case-insensitive)."""

    ADAM = "Adam"
    ADAMW = "AdamW"
    SGD = "SGD"


Device = Annotated[OffloadDevice, BeforeValidator(functools.partial(_choice, OffloadDevice))]


# --------------------------------------------------------------------------- key checking


def _annotation_section(annotation: Any) -> type[_Section] | None:
    """The :class:`_Section` subclass inside ``annotation`` (``X``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, _Section):
        return annotation
    for arg in typing.get_args(annotation):
        found = _annotation_section(arg)
        if found is not None:
            return found
    return None


def _is_auto(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() == "auto"
    if isinstance(value, list | tuple):
        return any(_is_auto(v) for v in value)
    return False


def _error(kind: str, message: str, loc: tuple[str, ...], value: Any) -> InitErrorDetails:
    # No context: the message is used literally (braces in user keys stay as they are).
    return InitErrorDetails(type=PydanticCustomError(kind, message, None), loc=loc, input=value)


class _Section(BaseModel):
    """Base of every config section: frozen, no extra keys, DeepSpeed-style key checks.

    Class attributes of subclasses:

    * ``_PATH``: where the section sits in a DeepSpeed config (used in messages).
    * ``_ALIASES``: canonical field name -> its other accepted spellings, the DeepSpeed
      documented one first (e.g. ``prefetch_bucket_size`` -> ``stage3_prefetch_bucket_size``);
      the list may name the field itself first when that is the documented spelling.
    * ``_HINTS``: keys that are not accepted but that users bring, with an explanation.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    _PATH: ClassVar[tuple[str, ...]] = ()
    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {}
    _HINTS: ClassVar[dict[str, str]] = {}

    @classmethod
    def accepted_keys(cls) -> list[str]:
        """Every key this section accepts, aliases included."""
        keys = list(cls.model_fields)
        for spellings in cls._ALIASES.values():
            keys += [s for s in spellings if s not in keys]
        return keys

    @classmethod
    def documented_key(cls, field: str) -> str:
        """The DeepSpeed documented spelling of ``field`` (its first alias, else itself)."""
        return cls._ALIASES.get(field, (field,))[0]

    @classmethod
    def _canonical_name(cls, key: str) -> str | None:
        if key in cls.model_fields:
            return key
        return next((c for c, spellings in cls._ALIASES.items() if key in spellings), None)

    @classmethod
    def _child_section(cls, key: str, data: Mapping[str, Any]) -> type[_Section] | None:
        """The section class that validates ``data[key]`` (``None`` for a scalar)."""
        name = cls._canonical_name(key)
        return None if name is None else _annotation_section(cls.model_fields[name].annotation)

    @classmethod
    def key_problems(
        cls, data: Mapping[str, Any], loc: tuple[str, ...] = (), prefix: tuple[str, ...] | None = None
    ) -> list[InitErrorDetails]:
        """Unknown keys, ``"auto"`` values and alias conflicts in ``data`` and its sub-sections.

        Args:
            data: The raw section.
            loc: Location of ``data`` below the section where the check started.
            prefix: DeepSpeed path of that starting section (default: this class's path).

        Returns:
            One pydantic error per problem, located at ``loc`` + key.
        """
        prefix = cls._PATH if prefix is None else prefix
        problems: list[InitErrorDetails] = []
        accepted = cls.accepted_keys()
        for key, value in data.items():
            path = ".".join((*prefix, *loc, str(key)))
            if not isinstance(key, str) or cls._canonical_name(key) is None:
                where = ".".join((*prefix, *loc)) or "the top level"
                message = cls._unknown_message(str(key), path, where, accepted)
                problems.append(_error("unknown_key", message, (*loc, str(key)), value))
                continue
            if _is_auto(value):
                message = (
                    f'{path} is {value!r}: "auto" values are filled in by the Hugging Face Trainer '
                    "integration and zero does not resolve them; replace it with a value"
                )
                problems.append(_error("auto_value", message, (*loc, key), value))
                continue
            child = cls._child_section(key, data)
            if child is not None and isinstance(value, Mapping):
                problems += child.key_problems(value, (*loc, key), prefix)
        problems += cls._alias_conflicts(data, ".".join((*prefix, *loc)), loc)
        return problems

    @classmethod
    def _unknown_message(cls, key: str, path: str, where: str, accepted: list[str]) -> str:
        if key in cls._HINTS:
            return f"unknown key {path!r}: {cls._HINTS[key]}"
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
        if close:
            return f"unknown key {path!r}; did you mean {close[0]!r}?"
        return f"unknown key {path!r}; keys accepted in {where}: {', '.join(sorted(accepted))}"

    @classmethod
    def _alias_conflicts(
        cls, data: Mapping[str, Any], where: str, loc: tuple[str, ...]
    ) -> list[InitErrorDetails]:
        problems = []
        for canonical, spellings in cls._ALIASES.items():
            given = [(s, data[s]) for s in dict.fromkeys((*spellings, canonical)) if s in data]
            first, first_value = given[0] if given else ("", None)
            for spelling, value in given[1:]:
                if value != first_value or isinstance(value, bool) != isinstance(first_value, bool):
                    message = (
                        f"{where + ': ' if where else ''}{first!r} = {first_value!r} and {spelling!r} = "
                        f"{value!r} are two spellings of one setting with different values; keep one"
                    )
                    problems.append(_error("alias_conflict", message, (*loc, spelling), value))
        return problems

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Hook: adjust the (canonical-named) input before field validation."""
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _check_keys(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, Mapping):
            problems = cls.key_problems(data)
            if problems:
                raise ValidationError.from_exception_data(cls.__name__, problems, hide_input=True)
            canonical = {cls._canonical_name(k): v for k, v in data.items()}
            data = cls._prepare(canonical)
        return handler(data)

    def given_keys(self) -> list[str]:
        """Documented names of the fields set explicitly in the input (aliases resolved)."""
        return [self.documented_key(f) for f in type(self).model_fields if f in self.model_fields_set]


# --------------------------------------------------------------------------- precision


class FP16Config(_Section):
    """``fp16``: half precision with loss scaling (DeepSpeed's names and defaults).

    ``loss_scale`` 0 means dynamic loss scaling (DeepSpeed's rule): start at
    ``2**initial_scale_power``; a step whose gradients overflow is skipped, and once
    ``hysteresis`` overflows have been absorbed the scale halves (never below
    ``min_loss_scale``); every ``loss_scale_window`` overflow-free steps the scale doubles
    and the hysteresis budget refills (with ``consecutive_hysteresis``, every overflow-free
    step refills it). A positive ``loss_scale`` is a static scale.
    """

    _PATH = ("fp16",)

    enabled: Flag = False
    auto_cast: Flag = False
    """DeepSpeed's cast of floating-point inputs to fp16; ``true`` is not supported yet."""
    loss_scale: _real(0) = 0.0
    initial_scale_power: _int(0, 127) = 16
    loss_scale_window: _int(1) = 1000
    hysteresis: _int(1) = 2
    consecutive_hysteresis: Flag = False
    min_loss_scale: _real(0, lo_open=True) = 1.0

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale is dynamic (``loss_scale`` == 0)."""
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        """The first loss scale: ``2**initial_scale_power`` if dynamic, else ``loss_scale``."""
        return float(2**self.initial_scale_power) if self.dynamic_loss_scale else self.loss_scale


class BF16Config(_Section):
    """``bf16`` (older DeepSpeed spelling: ``bfloat16``): bfloat16 training, no loss scaling."""

    _PATH = ("bf16",)

    enabled: Flag = False


# --------------------------------------------------------------------------- robustness


class NonFinitePolicy(str, enum.Enum):
    """What an fp32 / bf16 step does when some rank's gradients hold an inf or nan."""

    SKIP = "skip"
    RAISE = "raise"


class RobustnessConfig(_Section):
    """``robustness``: what zero checks so that failures are named instead of hanging or corrupting.

    Not a DeepSpeed section. See the "When things go wrong" page of the docs for every failure
    these keys govern and what zero says about it.
    """

    _PATH = ("robustness",)

    comm_timeout: _real(0, lo_open=True) = 300.0
    """Seconds a rank waits for one collective of the engine (forward, backward, step) before every live
    rank raises ``zero_comm.CollectiveTimeoutError`` saying which rank is where (which operation,
    call number, module or parameter), or which rank stopped sending heartbeats. Default 300 s:
    well under the process group's own 30 minutes, well above any healthy collective. Raise it for
    very slow links or very large first gathers."""
    heartbeat_interval: _real(0, lo_open=True) = 2.0
    """Seconds between two heartbeats (and position reports) each rank's watchdog thread writes to
    the process group's store; a rank silent for ``5 * heartbeat_interval`` seconds while the
    others wait is reported as dead or stuck."""
    watchdog: Flag = True
    """Run the collective watchdog (``false``: collectives block until the process group's own
    timeout, with torch's message)."""
    nonfinite_gradients: Annotated[
        NonFinitePolicy, BeforeValidator(functools.partial(_choice, NonFinitePolicy))
    ] = NonFinitePolicy.SKIP
    """fp32 / bf16: what a step does when some rank's gradients hold an inf or nan (found by the
    gradient-clipping norm, or by one all-reduce of a flag without clipping). ``skip`` (default):
    the step is skipped on every rank (the optimizer state does not move), with one warning naming
    the first non-finite parameter and the rank holding it; ``raise``: every rank raises
    ``zero_full.NonFiniteGradientError`` naming it. fp16 keeps its loss-scaler rule (skip and
    lower the scale)."""
    check_paths: Flag = False
    """Before every collective, all-gather a small signature (operation, call number, what it is
    for) and raise ``zero_comm.RanksDivergedError`` on every rank at the first difference, naming
    each rank's position. Off by default: it adds one small collective per collective. Turn it
    on when ranks take different paths (a module called on some ranks only): with gloo the
    mismatched sizes otherwise abort the process in C++ ("Received data size doesn't match
    expected size"), before any timeout could fire."""
    check_rank_agreement: Flag = True
    """At ``initialize``, compare every rank's parameter names, shapes, dtypes, ``requires_grad``
    flags and effective config values (one all-gather of digests) and raise on every rank naming
    the first difference, instead of aborting in the communication library later."""


# --------------------------------------------------------------------------- optimizer


def _check_betas(value: Any) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise PydanticCustomError("betas", f"expected two numbers [beta1, beta2] in [0, 1), got {value!r}")
    return tuple(_check_real(v, 0.0, 1.0, False, True) for v in value)  # type: ignore[return-value]


Betas = Annotated[tuple[float, float], BeforeValidator(_check_betas)]

_NO_MAX_GRAD_NORM = "gradient clipping is the top-level 'gradient_clipping' key (as in DeepSpeed)"


class AdamParams(_Section):
    """``optimizer.params`` of ``Adam`` / ``AdamW`` with DeepSpeed's defaults.

    DeepSpeed builds its Adam(W) with ``weight_decay=0.0`` unless told otherwise (torch's
    ``AdamW`` defaults to 0.01): this config follows DeepSpeed, since its users bring
    DeepSpeed configs. Likewise DeepSpeed's ``Adam`` applies *decoupled* weight decay
    (AdamW) unless ``adam_w_mode`` is ``false``; ``AdamW`` always does.
    """

    _PATH = ("optimizer", "params")
    _HINTS: ClassVar[dict[str, str]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: _real(0) = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: _real(0) = 1e-8
    weight_decay: _real(0) = 0.0
    amsgrad: Flag = False
    adam_w_mode: Flag = True
    """Decoupled weight decay for type ``Adam`` (DeepSpeed's default: true). No effect on ``AdamW``."""
    bias_correction: Flag = True
    """``false`` (no bias correction) is not supported: torch's Adam always corrects."""
    torch_adam: Flag = False
    """DeepSpeed's choice between torch's and its fused kernel; zero always uses torch's update.

    (DeepSpeed with ``torch_adam: true`` hands ``params`` to torch unchanged, so there a
    missing ``weight_decay`` means torch's 0.01; zero keeps 0.0: give it explicitly.)
    """


class SGDParams(_Section):
    """``optimizer.params`` of ``SGD`` (torch's names and defaults)."""

    _PATH = ("optimizer", "params")
    _HINTS: ClassVar[dict[str, str]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: _real(0) = 1e-3
    momentum: _real(0) = 0.0
    dampening: _real(0) = 0.0
    weight_decay: _real(0) = 0.0
    nesterov: Flag = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "optimizer.params.nesterov = true needs momentum > 0 and dampening = 0, got "
                f"momentum={self.momentum:g}, dampening={self.dampening:g}"
            )
        return self


_PARAMS_BY_TYPE: dict[OptimizerType, type[_Section]] = {
    OptimizerType.ADAM: AdamParams,
    OptimizerType.ADAMW: AdamParams,
    OptimizerType.SGD: SGDParams,
}


def _optimizer_type(value: Any) -> OptimizerType:
    return _choice(OptimizerType, value)  # type: ignore[return-value]


class OptimizerConfig(_Section):
    """``optimizer``: ``{"type": "AdamW", "params": {...}}``; ``params`` is checked per type.

    ``type`` is case-insensitive (``adamw`` = ``AdamW``). :meth:`build` creates the torch
    optimizer the section describes.
    """

    _PATH = ("optimizer",)

    type: Annotated[OptimizerType, BeforeValidator(_optimizer_type)]
    params: AdamParams | SGDParams

    @classmethod
    def _child_section(cls, key: str, data: Mapping[str, Any]) -> type[_Section] | None:
        if key != "params":
            return super()._child_section(key, data)
        try:
            return _PARAMS_BY_TYPE[_optimizer_type(data.get("type"))]
        except PydanticCustomError:
            return None  # the bad type is reported by field validation

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("params") is None:
            data["params"] = {}  # every default of the type
        return data

    @field_validator("params", mode="wrap")
    @classmethod
    def _params_of_type(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("type")
        if kind is None:
            return None  # ``type`` itself is invalid and reported; its params cannot be checked
        params_cls = _PARAMS_BY_TYPE[kind]
        if isinstance(value, params_cls):
            return value
        if isinstance(value, _Section):
            raise PydanticCustomError(
                "params_type",
                f"optimizer type {kind.value} takes {params_cls.__name__}, got {type(value).__name__}",
            )
        return params_cls.model_validate(value)

    @property
    def decoupled_weight_decay(self) -> bool:
        """Whether weight decay is decoupled (AdamW); DeepSpeed's rule for ``Adam`` is ``adam_w_mode``."""
        if self.type is OptimizerType.ADAMW:
            return True
        return (
            self.type is OptimizerType.ADAM
            and isinstance(self.params, AdamParams)
            and self.params.adam_w_mode
        )

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the torch optimizer :meth:`build` creates (``params`` excluded)."""
        p = self.params
        if isinstance(p, SGDParams):
            return {
                "lr": p.lr,
                "momentum": p.momentum,
                "dampening": p.dampening,
                "weight_decay": p.weight_decay,
                "nesterov": p.nesterov,
            }
        if not isinstance(p, AdamParams):
            raise TypeError(f"optimizer.params of type {self.type.value} is a {type(p).__name__}")
        return {
            "lr": p.lr,
            "betas": p.betas,
            "eps": p.eps,
            "weight_decay": p.weight_decay,
            "amsgrad": p.amsgrad,
        }

    def build(self, params: Iterable[Any]) -> Any:
        """Create the torch optimizer: ``torch.optim.AdamW``, ``Adam`` or ``SGD``.

        Args:
            params: Parameters or parameter groups, as for any torch optimizer.

        Returns:
            A ``torch.optim.Optimizer``. ``Adam`` with ``adam_w_mode`` (DeepSpeed's default)
            becomes ``torch.optim.AdamW``, as in DeepSpeed.

        Raises:
            ValueError: ``bias_correction = false``, which torch's Adam cannot do.
        """
        import torch  # lazily: the config itself needs only pydantic

        if isinstance(self.params, AdamParams) and not self.params.bias_correction:
            raise ValueError(
                "optimizer.params.bias_correction = false is not supported (torch's Adam always "
                "applies bias correction); remove the key"
            )
        if self.type is OptimizerType.SGD:
            cls = torch.optim.SGD
        else:
            cls = torch.optim.AdamW if self.decoupled_weight_decay else torch.optim.Adam
        return cls(params, **self.torch_kwargs())


# --------------------------------------------------------------------------- zero_optimization


class OffloadParamConfig(_Section):
    """``zero_optimization.offload_param`` (stage 3 only), DeepSpeed's defaults."""

    _PATH = ("zero_optimization", "offload_param")

    device: Device = OffloadDevice.NONE
    nvme_path: OptionalPath = None
    buffer_count: _int(0) = 5
    buffer_size: _int(0) = 100_000_000
    max_in_cpu: _int(0) = 1_000_000_000
    pin_memory: Flag = False

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadParamConfig:
        _require_nvme_path(self.device, self.nvme_path, "offload_param")
        return self

    @property
    def enabled(self) -> bool:
        """Whether parameters are offloaded (``device`` is not ``none``)."""
        return self.device is not OffloadDevice.NONE

    def to_param_offload_config(self) -> ParamOffloadConfig | None:
        """This section as a ``zero_offload.ParamOffloadConfig`` (``None`` when not offloaded)."""
        from zero_offload import OffloadTarget, ParamOffloadConfig

        if not self.enabled:
            return None
        return ParamOffloadConfig(
            device=OffloadTarget(self.device.value),
            nvme_path=self.nvme_path,
            buffer_count=max(self.buffer_count, 1),
            buffer_size=max(self.buffer_size, 1),
            max_in_cpu=max(self.max_in_cpu, 1),
            pin_memory=self.pin_memory,
        )


class OffloadOptimizerConfig(_Section):
    """``zero_optimization.offload_optimizer`` (stages 1-3), DeepSpeed's defaults.

    ``ratio`` < 1 (partial offload) is valid with stage 3 only, as in DeepSpeed.
    """

    _PATH = ("zero_optimization", "offload_optimizer")

    device: Device = OffloadDevice.NONE
    nvme_path: OptionalPath = None
    buffer_count: _int(0) = 4
    pin_memory: Flag = False
    pipeline_read: Flag = False
    pipeline_write: Flag = False
    fast_init: Flag = False
    ratio: _real(0, 1) = 1.0

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OffloadOptimizerConfig:
        _require_nvme_path(self.device, self.nvme_path, "offload_optimizer")
        return self

    @property
    def enabled(self) -> bool:
        """Whether optimizer state is offloaded (``device`` is not ``none``)."""
        return self.device is not OffloadDevice.NONE

    def to_offload_config(self, sub_group_size: int) -> OptimizerOffloadConfig | None:
        """This section as a ``zero_offload.OptimizerOffloadConfig`` (``None`` when not offloaded)."""
        from zero_offload import OffloadTarget, OptimizerOffloadConfig

        if not self.enabled:
            return None
        return OptimizerOffloadConfig(
            device=OffloadTarget(self.device.value),
            nvme_path=self.nvme_path,
            buffer_count=self.buffer_count,
            pin_memory=self.pin_memory,
            pipeline_read=self.pipeline_read,
            pipeline_write=self.pipeline_write,
            sub_group_size=sub_group_size,
            ratio=self.ratio,
        )


def _require_nvme_path(device: OffloadDevice, path: pathlib.Path | None, section: str) -> None:
    if device is OffloadDevice.NVME and path is None:
        raise ValueError(
            f"zero_optimization.{section}.device is 'nvme' but no nvme_path is given: add "
            f'"nvme_path": "/path/on/nvme" to zero_optimization.{section}'
        )


_DEPRECATED_OFFLOAD = 'a deprecated DeepSpeed key; use {{"{new}": {{"device": "cpu"}}}} instead'


class ZeroppLocoConfig(_Section):
    """``zero_optimization.zeropp_loco_param``: error feedback of qgZ (DeepSpeed's names)."""

    _PATH = ("zero_optimization", "zeropp_loco_param")

    err_beta: _real(0, 1, hi_open=True) = 0.8
    """Moving-average factor of the qgZ error buffer, in [0, 1): each reduction folds this rank's
    int4 quantization error into the buffer as ``e = err_beta * e + (1 - err_beta) * error`` and
    adds the buffer to the next gradient before quantizing it (0: classic error feedback)."""
    reset_T: _int(1) = 1024  # noqa: N815 - DeepSpeed's key
    """Optimizer steps between resets of the qgZ error buffers to zero."""

    def to_feedback_config(self) -> ErrorFeedbackConfig:
        """This section as a ``zero_comm.ErrorFeedbackConfig``."""
        from zero_comm.qgz_feedback import ErrorFeedbackConfig

        return ErrorFeedbackConfig(err_beta=float(self.err_beta), reset_t=int(self.reset_T))


# zero_optimization knobs -> the stages that use them (the others ignore them, as DeepSpeed does)
_STAGE3 = frozenset({3})
_STAGE12 = frozenset({1, 2})
KNOB_STAGES: dict[str, frozenset[int]] = {
    "prefetch_bucket_size": _STAGE3,
    "param_persistence_threshold": _STAGE3,
    "model_persistence_threshold": _STAGE3,
    "max_live_parameters": _STAGE3,
    "max_reuse_distance": _STAGE3,
    "gather_16bit_weights_on_model_save": _STAGE3,
    "offload_param": _STAGE3,
    "zero_hpz_partition_size": _STAGE3,
    "zero_quantized_weights": _STAGE3,
    "zero_quantized_nontrainable_weights": _STAGE3,
    "zero_quantized_gradients": _STAGE3,
    "zeropp_loco_param": _STAGE3,
    "mics_shard_size": _STAGE3,
    "mics_hierarchical_params_gather": _STAGE3,
    "round_robin_gradients": _STAGE12,
    "allgather_partitions": _STAGE12,
    "allgather_bucket_size": _STAGE12,
    "offload_optimizer": frozenset({1, 2, 3}),
}


class ZeroOptimizationConfig(_Section):
    """``zero_optimization``: DeepSpeed's ZeRO keys, names and defaults.

    Every stage-3 knob is accepted with and without its ``stage3_`` prefix
    (``stage3_prefetch_bucket_size`` / ``prefetch_bucket_size``); the attribute is the
    short name. ``stage3_gather_fp16_weights_on_model_save`` (DeepSpeed's older name) is
    one more spelling of ``gather_16bit_weights_on_model_save``. Sizes are element
    counts; whole floats such as ``5e8`` are accepted. ``overlap_comm`` defaults to true
    for stage 3 and false otherwise, as in DeepSpeed.

    ``overlap_comm``, ``contiguous_gradients``, ``reduce_scatter`` and the bucket sizes
    are performance settings: they never change the numbers a step computes.
    """

    _PATH = ("zero_optimization",)
    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "prefetch_bucket_size": ("stage3_prefetch_bucket_size",),
        "param_persistence_threshold": ("stage3_param_persistence_threshold",),
        "model_persistence_threshold": ("stage3_model_persistence_threshold",),
        "max_live_parameters": ("stage3_max_live_parameters",),
        "max_reuse_distance": ("stage3_max_reuse_distance",),
        "gather_16bit_weights_on_model_save": (
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    }
    _HINTS: ClassVar[dict[str, str]] = {
        "cpu_offload": _DEPRECATED_OFFLOAD.format(new="offload_optimizer"),
        "cpu_offload_param": _DEPRECATED_OFFLOAD.format(new="offload_param"),
        "cpu_offload_use_pin_memory": "a deprecated DeepSpeed key; use offload_optimizer.pin_memory / "
        "offload_param.pin_memory instead",
    }

    stage: _int(0, 3) = 0
    overlap_comm: Flag = False
    contiguous_gradients: Flag = True
    reduce_scatter: Flag = True
    reduce_bucket_size: _int(1) = 500_000_000
    allgather_partitions: Flag = True
    allgather_bucket_size: _int(1) = 500_000_000
    round_robin_gradients: Flag = False
    sub_group_size: _int(1) = 1_000_000_000
    """Every stage: elements of a flat optimizer partition stepped at once (and, with
    `offload_optimizer`, swapped at once). The optimizer's temporaries (e.g. AdamW's
    per-element intermediates, up to ~2 fp32 tensors of this size) are bounded by it, not by
    the model; smaller values cost more Python calls per step."""
    load_from_fp32_weights: Flag = True
    """``false`` (initialise fp32 master weights from the 16-bit ones) is not supported yet."""
    ignore_unused_parameters: Flag = True
    """``false`` (fail when a parameter receives no gradient) is not supported yet."""
    prefetch_bucket_size: _int(0) = 50_000_000
    param_persistence_threshold: _int(0) = 100_000
    model_persistence_threshold: _int(0) = sys.maxsize
    max_live_parameters: _int(0) = 1_000_000_000
    max_reuse_distance: _int(0) = 1_000_000_000
    gather_16bit_weights_on_model_save: Flag = False
    zero_hpz_partition_size: _int(1) = 1
    zero_quantized_weights: Flag = False
    zero_quantized_nontrainable_weights: Flag = False
    zero_quantized_gradients: Flag = False
    zeropp_loco_param: ZeroppLocoConfig | None = None
    """Stage 3 with ``zero_quantized_gradients``: error feedback for qgZ, DeepSpeed's
    ``{"err_beta": 0.8, "reset_T": 1024}`` (section below); absent or null: no error feedback.
    Costs one buffer per quantized gradient, of the gradient's full size, in working precision."""
    mics_shard_size: _int(-1) = -1
    """Ranks per MiCS shard group (stage 3); -1 (or 0) turns MiCS off. Must divide the world
    size (checked by ``initialize`` / ``Init``, where the world is known)."""
    mics_hierarchical_params_gather: Flag = False
    """MiCS: gather in two hops (inter-node, then intra-node); needs ``mics_shard_size`` set to a
    multiple of the ranks per node spanning >= 2 nodes."""
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        # DeepSpeed: overlap_comm defaults to true for stage 3, false otherwise.
        if "overlap_comm" not in data and isinstance(data.get("stage"), int | float):
            data["overlap_comm"] = data["stage"] == 3
        # DeepSpeed accepts "offload_param": null for "no offload".
        for key in ("offload_param", "offload_optimizer", "zeropp_loco_param"):
            if key in data and data[key] is None:
                del data[key]
        return data

    @model_validator(mode="after")
    def _partial_offload_needs_stage3(self) -> ZeroOptimizationConfig:
        if self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio = {self.offload_optimizer.ratio:g} (partial "
                f"offload) needs stage 3, got stage {self.stage}; set ratio to 1.0 or use stage 3"
            )
        return self

    @model_validator(mode="after")
    def _hierarchical_gather_needs_mics(self) -> ZeroOptimizationConfig:
        if self.stage == 3 and self.mics_hierarchical_params_gather and not self.mics_enabled:
            raise ValueError(
                "zero_optimization.mics_hierarchical_params_gather = true needs MiCS: set "
                f"mics_shard_size to the shard group size (got {self.mics_shard_size}), or turn the "
                "hierarchical gather off"
            )
        return self

    @model_validator(mode="after")
    def _zeropp_needs_stage3(self) -> ZeroOptimizationConfig:
        if self.stage == 3:
            if self.loco_enabled and not self.zero_quantized_gradients:
                raise ValueError(
                    "zero_optimization.zeropp_loco_param is the error feedback of qgZ and needs "
                    "zero_quantized_gradients = true (got false); set it or drop zeropp_loco_param"
                )
            return self
        wanted = [
            f"{k} = true"
            for k in (
                "zero_quantized_weights",
                "zero_quantized_gradients",
                "zero_quantized_nontrainable_weights",
            )
            if getattr(self, k)
        ]
        if self.zero_hpz_partition_size > 1:
            wanted.append(f"zero_hpz_partition_size = {self.zero_hpz_partition_size}")
        if wanted:
            raise ValueError(
                f"zero_optimization.{', '.join(wanted)} (ZeRO++) needs stage 3, got stage {self.stage}: "
                "ZeRO++ quantizes and re-partitions the stage-3 parameter gathers and gradient "
                "reduction; set stage to 3 or turn these keys off"
            )
        return self

    @property
    def loco_enabled(self) -> bool:
        """Whether qgZ error feedback was asked for (``zeropp_loco_param`` given, not null)."""
        return self.zeropp_loco_param is not None

    @property
    def zeropp_enabled(self) -> bool:
        """Whether any ZeRO++ feature is requested (stage 3)."""
        return self.stage == 3 and (
            self.zero_quantized_weights
            or self.zero_quantized_gradients
            or self.zero_quantized_nontrainable_weights
            or self.zero_hpz_partition_size > 1
        )

    @property
    def mics_enabled(self) -> bool:
        """Whether MiCS is requested (``mics_shard_size`` > 0)."""
        return self.mics_shard_size > 0

    def to_coordinator_config(self) -> CoordinatorConfig:
        """The ZeRO-3 fetch / prefetch / release policy as a ``zero_coord.CoordinatorConfig``."""
        from zero_coord import CoordinatorConfig

        return CoordinatorConfig(
            prefetch_bucket_size=self.prefetch_bucket_size,
            max_live_parameters=self.max_live_parameters,
            max_reuse_distance=self.max_reuse_distance,
        )

    def to_reduce_config(self) -> ReduceConfig:
        """The gradient bucketing policy as a ``zero_optim`` ``ReduceConfig``."""
        from zero_optim.buckets import ReduceConfig

        return ReduceConfig(reduce_bucket_size=self.reduce_bucket_size, overlap_comm=self.overlap_comm)

    def ignored_keys(self) -> list[str]:
        """Full paths of the keys given that the chosen stage (or device) does not use."""
        ignored = [
            f"zero_optimization.{self.documented_key(name)}"
            for name, stages in KNOB_STAGES.items()
            if name in self.model_fields_set and self.stage not in stages
        ]
        for name in ("offload_param", "offload_optimizer"):
            section = getattr(self, name)
            if name in self.model_fields_set and self.stage in KNOB_STAGES[name]:
                if "nvme_path" in section.model_fields_set and section.device is not OffloadDevice.NVME:
                    ignored.append(f"zero_optimization.{name}.nvme_path")
        if self.stage == 3 and self.zero_quantized_nontrainable_weights:
            # frozen weights are stored in the working precision in this version (docs/zeropp.md)
            ignored.append("zero_optimization.zero_quantized_nontrainable_weights")
        if "fast_init" in self.offload_optimizer.model_fields_set:
            # zero writes the initial swap files in one pass whatever this says
            ignored.append("zero_optimization.offload_optimizer.fast_init")
        return ignored
