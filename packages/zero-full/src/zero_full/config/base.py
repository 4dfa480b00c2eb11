"""The base of every config section: DeepSpeed-style key checks, and what a given config's keys amount to."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from zero_full.config.types import Ignored, Key, Refused, Rejected, parse_choice

__all__ = ["KeyFinding", "KeyReport", "Section", "TypedSection", "declared_key", "key_report", "section_in"]


def section_in(annotation: Any) -> type[Section] | None:
    """The :class:`Section` subclass inside ``annotation`` (``X``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_in(arg)
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


class Section(BaseModel):
    """Base of every config section: frozen, no extra keys, DeepSpeed-style key checks.

    Class attributes of subclasses:

    * ``_PATH``: where the section sits in a DeepSpeed config (used in messages).
    * ``_ALIASES``: canonical field name -> its other accepted spellings, the DeepSpeed
      documented one first (e.g. ``prefetch_bucket_size`` -> ``stage3_prefetch_bucket_size``);
      the list may name the field itself first when that is the documented spelling.
    * ``_REJECTED``: DeepSpeed keys that are not accepted but that users bring, with what to do.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    _PATH: ClassVar[tuple[str, ...]] = ()
    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {}
    _REJECTED: ClassVar[dict[str, Rejected]] = {}

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
    def rejected_keys(cls) -> dict[str, Rejected]:
        """DeepSpeed keys this section refuses at validation, with the reason the error gives."""
        return dict(cls._REJECTED)

    @classmethod
    def _canonical_name(cls, key: str) -> str | None:
        if key in cls.model_fields:
            return key
        return next((c for c, spellings in cls._ALIASES.items() if key in spellings), None)

    @classmethod
    def _child_section(cls, key: str, data: Mapping[str, Any]) -> type[Section] | None:
        """The section class that validates ``data[key]`` (``None`` for a scalar)."""
        name = cls._canonical_name(key)
        return None if name is None else section_in(cls.model_fields[name].annotation)

    @classmethod
    def key_problems(
        cls, data: Mapping[str, Any], loc: tuple[str, ...] = (), prefix: tuple[str, ...] | None = None
    ) -> list[InitErrorDetails]:
        """Unknown keys, ``"auto"`` values and alias conflicts in ``data`` and its sub-sections."""
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
        if key in cls._REJECTED:
            return f"unknown key {path!r}: {cls._REJECTED[key].reason}"
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


class TypedSection(Section):
    """A section ``{"type": ..., "params": {...}}`` whose ``params`` are checked per ``type``.

    Subclasses declare the two fields ``type`` (a :func:`~zero_full.config.types.Choice` of
    ``_TYPES``) and ``params``, and map each type to its parameter section in ``_PARAMS_BY_TYPE``.
    ``params`` omitted or ``null`` means every default of the type.
    """

    _TYPES: ClassVar[type[enum.Enum]]
    _PARAMS_BY_TYPE: ClassVar[Mapping[Any, type[Section]]] = {}
    _REFUSED_TYPES: ClassVar[Mapping[str, str]] = {}
    """DeepSpeed types zero does not have: name -> why, and what to use instead."""

    @classmethod
    def refused_types(cls) -> dict[str, str]:
        """DeepSpeed types this section refuses by name, with the reason the error gives."""
        return dict(cls._REFUSED_TYPES)

    @classmethod
    def params_sections(cls) -> dict[type[Section], list[str]]:
        """Each parameter section, with the types it serves (for the reference page)."""
        found: dict[type[Section], list[str]] = {}
        for kind, params_cls in cls._PARAMS_BY_TYPE.items():
            found.setdefault(params_cls, []).append(kind.value)
        return found

    @classmethod
    def _child_section(cls, key: str, data: Mapping[str, Any]) -> type[Section] | None:
        if key != "params":
            return super()._child_section(key, data)
        try:
            return cls._PARAMS_BY_TYPE.get(parse_choice(cls._TYPES, data.get("type")))
        except PydanticCustomError:
            return None  # the bad type is reported by field validation

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("params") is None:
            data["params"] = {}  # every default of the type
        return data

    @field_validator("type", mode="before", check_fields=False)
    @classmethod
    def _refuse_type(cls, value: Any) -> Any:
        if isinstance(value, str):
            for name, reason in cls._REFUSED_TYPES.items():
                if value.lower() == name.lower():
                    raise PydanticCustomError(
                        "refused_type", f"{'.'.join(cls._PATH)}.type = {value!r}: {reason}"
                    )
        return value

    @field_validator("params", mode="wrap", check_fields=False)
    @classmethod
    def _params_of_type(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("type")
        if kind is None:
            return None  # ``type`` itself is invalid and reported; its params cannot be checked
        params_cls = cls._PARAMS_BY_TYPE[kind]
        if isinstance(value, params_cls):
            return value
        if isinstance(value, Section):
            raise PydanticCustomError(
                "params_type",
                f"{'.'.join(cls._PATH)} type {kind.value} takes {params_cls.__name__}, "
                f"got {type(value).__name__}",
            )
        return params_cls.model_validate(value)


# --------------------------------------------------------------------------- what the keys amount to


def declared_key(cls: type[Section], field: str) -> Key:
    """The :class:`~zero_full.config.types.Key` declared in the type of ``cls.field``.

    Raises:
        TypeError: the field declares none (every field must: ``Annotated[T, Key(...)]``).
    """
    found = [m for m in cls.model_fields[field].metadata if isinstance(m, Key)]
    if len(found) != 1:
        raise TypeError(
            f"{cls.__name__}.{field} declares {len(found)} Key(...) in its type; declare exactly one: "
            f"{field}: Annotated[<type>, Key(IMPLEMENTED | Ignored(why) | Refused(why, supported))]"
        )
    return found[0]


def json_text(value: Any) -> str:
    """A config value as JSON writes it (``true``, ``2``); ``str`` for what JSON cannot hold."""
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """A key of a config by its full path (``zero_optimization.stage``), and the value given."""

    path: str
    value: Any

    def value_text(self) -> str:
        """The value as JSON writes it (``true``, ``2``)."""
        return json_text(self.value)


@dataclasses.dataclass(frozen=True)
class KeyFinding(KeyValue):
    """One key of a validated config that is ignored or refused."""

    reason: str


@dataclasses.dataclass(frozen=True)
class KeyReport:
    """What :func:`key_report` found: keys given without effect, and values zero refuses."""

    ignored: tuple[KeyFinding, ...]
    refused: tuple[KeyFinding, ...]


def _stages_text(stages: frozenset[int]) -> str:
    return ", ".join(str(s) for s in sorted(stages))


def _unused_because(key: Key, section: Section, parent: Section | None, stage: int) -> str | None:
    """Why ``key`` of ``section`` is not used by this config (``None``: it is used)."""
    if stage not in key.stages:
        return f"used at stage {_stages_text(key.stages)} only; this config is stage {stage}"
    if key.when is not None and not key.when.test(section, parent):
        return f"used only when {key.when.text}"
    return None


def key_report(section: Section, stage: int) -> KeyReport:
    """The keys of ``section`` (and the sections below it) given without effect, and refused values."""
    ignored: list[KeyFinding] = []
    refused: list[KeyFinding] = []

    def visit(node: Section, parent: Section | None) -> None:
        cls = type(node)
        for name in cls.model_fields:
            key, value = declared_key(cls, name), getattr(node, name)
            given = name in node.model_fields_set
            path = ".".join((*cls._PATH, cls.documented_key(name)))
            unused = _unused_because(key, node, parent, stage)
            if unused is not None:
                if given:
                    ignored.append(KeyFinding(path, value, unused))
                continue
            status = key.status
            if isinstance(status, Ignored) and given and status.reports(value):
                ignored.append(KeyFinding(path, value, status.reason))
            elif isinstance(status, Refused) and status.refuses(value):
                refused.append(KeyFinding(path, value, status.reason))
            if isinstance(value, Section):
                visit(value, node)

    visit(section, None)
    return KeyReport(tuple(ignored), tuple(refused))
