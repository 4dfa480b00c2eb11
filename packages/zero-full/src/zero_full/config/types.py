"""Value types of the config sections and the declaration each key carries."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import pathlib
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

__all__ = [
    "ALL_STAGES",
    "IMPLEMENTED",
    "Betas",
    "Choice",
    "Flag",
    "Ignored",
    "Implemented",
    "Int",
    "Key",
    "OptionalPath",
    "OptionalPerGroup",
    "PerGroup",
    "Real",
    "Refused",
    "Rejected",
    "USED",
    "UsedWhen",
    "check_betas",
    "check_flag",
    "check_int",
    "check_path",
    "check_per_group",
    "check_real",
    "describe_range",
    "parse_choice",
]

ALL_STAGES: frozenset[int] = frozenset({0, 1, 2, 3})
"""The ZeRO stages (the default of :attr:`Key.stages`)."""


# --------------------------------------------------------------------------- scalar checks


def describe_range(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    """The range as messages say it: ``" in [0, 3]"``, ``" > 0"``, ``" >= 1"`` (empty: unbounded)."""
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi:g}"
    return ""


def check_int(value: Any, lo: int | None, hi: int | None, none_ok: bool = False) -> int | None:
    """A whole number: an int, or a float without fraction (DeepSpeed configs write ``5e8``)."""
    if value is None and none_ok:
        return None
    rng = describe_range(lo, hi)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PydanticCustomError("whole_number", f"expected a whole number{rng}, got {value!r}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise PydanticCustomError("whole_number", f"expected a whole number{rng}, got {value!r}")
        value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise PydanticCustomError("out_of_range", f"expected a whole number{rng}, got {value}")
    return value


def check_real(value: Any, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> float:
    """A finite number (int or float, not bool) in the range."""
    rng = describe_range(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PydanticCustomError("number", f"expected a number{rng}, got {value!r}")
    value = float(value)
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and (value >= hi if hi_open else value > hi)
    if too_low or too_high:
        raise PydanticCustomError("out_of_range", f"expected a number{rng}, got {value:g}")
    return value


def check_flag(value: Any) -> bool:
    """``true`` or ``false`` only (not ``0`` / ``1`` / ``"yes"``)."""
    if not isinstance(value, bool):
        raise PydanticCustomError("boolean", f"expected true or false, got {value!r}")
    return value


def check_path(value: Any) -> pathlib.Path | None:
    """A non-empty path string (or ``None``)."""
    if value is None:
        return None
    if not isinstance(value, str | pathlib.PurePath) or not str(value):
        raise PydanticCustomError("path", f"expected a non-empty path string, got {value!r}")
    return pathlib.Path(value)


def check_betas(value: Any) -> tuple[float, float]:
    """Two numbers ``[beta1, beta2]``, each in ``[0, 1)``."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise PydanticCustomError("betas", f"expected two numbers [beta1, beta2] in [0, 1), got {value!r}")
    return tuple(check_real(v, 0.0, 1.0, False, True) for v in value)  # type: ignore[return-value]


def check_per_group(value: Any, none_ok: bool = False) -> float | tuple[float, ...] | None:
    """One number >= 0 for every parameter group, or a list with one per group (DeepSpeed's schedules)."""
    if value is None and none_ok:
        return None
    if isinstance(value, list | tuple):
        if not value:
            raise PydanticCustomError("per_group", "expected a number or a non-empty list of numbers, got []")
        return tuple(check_real(v, 0.0, None, False, False) for v in value)
    return check_real(value, 0.0, None, False, False)


def parse_choice(enum_cls: type[enum.Enum], value: Any) -> enum.Enum:
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


def Int(lo: int | None = None, hi: int | None = None, *, none_ok: bool = False) -> Any:  # noqa: N802
    """``int`` type accepting whole numbers in ``[lo, hi]`` (and ``None`` if ``none_ok``)."""
    check = BeforeValidator(functools.partial(check_int, lo=lo, hi=hi, none_ok=none_ok))
    return Annotated[int | None, check] if none_ok else Annotated[int, check]


def Real(  # noqa: N802
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Any:
    """``float`` type accepting finite numbers in the given range."""
    check = functools.partial(check_real, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open)
    return Annotated[float, BeforeValidator(check)]


def Choice(enum_cls: type[enum.Enum]) -> Any:  # noqa: N802
    """``enum_cls`` type parsed from its values, any case (see :func:`parse_choice`)."""
    return Annotated[enum_cls, BeforeValidator(functools.partial(parse_choice, enum_cls))]


Flag = Annotated[bool, BeforeValidator(check_flag)]
"""``bool`` type accepting only ``true`` / ``false``."""
OptionalPath = Annotated[pathlib.Path | None, BeforeValidator(check_path)]
"""A filesystem path or ``None``."""
PerGroup = Annotated[float | tuple[float, ...], BeforeValidator(check_per_group)]
"""A number >= 0 for every parameter group, or a list with one per group."""
OptionalPerGroup = Annotated[
    float | tuple[float, ...] | None, BeforeValidator(functools.partial(check_per_group, none_ok=True))
]
""":data:`PerGroup` or ``None``."""
Betas = Annotated[tuple[float, float], BeforeValidator(check_betas)]
"""Adam's ``[beta1, beta2]``."""


# --------------------------------------------------------------------------- key declarations


@dataclasses.dataclass(frozen=True)
class Implemented:
    """The key has its effect (wherever its :class:`Key` says it is used)."""


IMPLEMENTED = Implemented()
"""The status of a key that has its effect."""


@dataclasses.dataclass(frozen=True)
class Ignored:
    """Accepted for DeepSpeed compatibility, with no effect in zero."""

    reason: str
    behaves_as: bool | int | None = None

    def reports(self, value: Any) -> bool:
        """Whether a given ``value`` is listed by ``ignored_keys()``."""
        return self.behaves_as is None or value != self.behaves_as


@dataclasses.dataclass(frozen=True)
class Refused:
    """Accepted and validated, but not implemented yet: ``initialize`` refuses other values.

    Attributes:
        reason: What the feature is, e.g. ``"ZeRO++ quantized weight all-gather, qwZ"``.
        supported: The one value zero runs with (the default).
    """

    reason: str
    supported: bool | int

    def refuses(self, value: Any) -> bool:
        """Whether ``value`` is listed by ``unsupported_features()``."""
        return value != self.supported


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A DeepSpeed key a section does not accept: the validation error says ``reason``."""

    reason: str


@dataclasses.dataclass(frozen=True)
class UsedWhen:
    """A condition, besides the stage, under which a key is used (else a given key is ignored)."""

    text: str
    test: Callable[[Any, Any], bool]


@dataclasses.dataclass(frozen=True)
class Key:
    """The declaration of one config key, in its field's ``Annotated`` type."""

    status: Implemented | Ignored | Refused
    stages: frozenset[int] = ALL_STAGES
    when: UsedWhen | None = None
    default_text: str | None = None


USED = Key(IMPLEMENTED)
"""The declaration of a key that has its effect at every stage, wherever its section is used."""
