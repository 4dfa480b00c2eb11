"""The configuration reference, rendered from the config sections themselves."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BeforeValidator, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from zero_full.config.base import Section, TypedSection, declared_key
from zero_full.config.deepspeed_keys import DEEPSPEED_KEYS, Known
from zero_full.config.types import (
    Ignored,
    Implemented,
    Refused,
    check_betas,
    check_flag,
    check_int,
    check_path,
    check_per_group,
    check_real,
    parse_choice,
)
from zero_full.config.zero_config import ZeroConfig

__all__ = ["ALL_STAGES", "ConfigKey", "SectionDoc", "config_keys", "config_sections", "render_markdown"]

ALL_STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""The ZeRO stages (the ``stages`` of a key every stage uses)."""


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One accepted key of the configuration."""

    section: tuple[str, ...]
    field: str
    spellings: tuple[str, ...]
    type: str
    default: Any
    default_text: str
    stages: tuple[int, ...]
    description: str
    status: Implemented | Ignored | Refused

    @property
    def name(self) -> str:
        """DeepSpeed's documented spelling."""
        return self.spellings[0]

    @property
    def path(self) -> str:
        """The full dotted path with DeepSpeed's spelling, e.g. ``zero_optimization.stage``."""
        return ".".join((*self.section, self.name))


@dataclasses.dataclass(frozen=True)
class SectionDoc:
    """One section of the configuration and its keys."""

    path: tuple[str, ...]
    title: str
    cls: type[Section]
    intro: str
    keys: tuple[ConfigKey, ...]


# --------------------------------------------------------------------------- introspection


def _rst_to_md(text: str) -> str:
    """Docstring text (reST inline markup) as one markdown paragraph."""
    text = re.sub(r":(?:class|meth|func|attr|mod):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(text.split())


@functools.cache
def _field_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after ``name: T = ...``) of ``cls`` itself."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # pragma: no cover - source not available
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _first_paragraph(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    return doc.split("\n\n")[0]


def _description(cls: type[Section], field: str) -> str:
    """The field's docstring (first paragraph), then when it is used and its status."""
    # a field inherited from a parent section keeps the parent's docstring
    owners = [c for c in cls.__mro__ if isinstance(c, type) and issubclass(c, Section) and c is not Section]
    text = next((d[field] for d in map(_field_docstrings, owners) if field in d), "")
    parts = [_rst_to_md(text.split("\n\n")[0])] if text else []
    key = declared_key(cls, field)
    if key.when is not None:
        parts.append(f"Used only when {key.when.text}.")
    status = key.status
    if isinstance(status, Ignored):
        when = "" if status.behaves_as is None else f" with a value other than `{_json(status.behaves_as)}`"
        parts.append(f"**No effect in zero**: {status.reason} (`ignored_keys()` lists it when given{when}).")
    elif isinstance(status, Refused):
        parts.append(
            f"**Not implemented yet** ({status.reason}): `initialize` refuses any value but "
            f"`{_json(status.supported)}`."
        )
    return " ".join(parts)


def _known_outcome(known: Known) -> str:
    if known.refuses(True) or known.refuses({"enabled": True}) or known.refuses(2):
        return 'refused unless off (`false`, `"enabled": false`, the default)'
    if known.rewrite is not None:
        return "rewritten to the zero form, reported"
    return "reported unless its value changes nothing"


def _json(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _sections_in(annotation: Any) -> list[type[Section]]:
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    found: list[type[Section]] = []
    for arg in typing.get_args(annotation):
        found += [s for s in _sections_in(arg) if s not in found]
    return found


def _validator(info: FieldInfo) -> Any:
    return next((m.func for m in info.metadata if isinstance(m, BeforeValidator)), None)


def _fmt_number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _type_text(info: FieldInfo) -> str:
    """What the field's validator accepts, e.g. ``int in [0, 3]``."""
    sections = _sections_in(info.annotation)
    if sections:
        nullable = type(None) in typing.get_args(info.annotation)
        return "object or null" if nullable else "object"
    check = _validator(info)
    base = check.func if isinstance(check, functools.partial) else check
    kw = check.keywords if isinstance(check, functools.partial) else {}
    if base is check_int or base is check_real:
        kind = "int" if base is check_int else "number"
        lo, hi = kw.get("lo"), kw.get("hi")
        lo_op = ">" if kw.get("lo_open") else ">="
        hi_op = "<" if kw.get("hi_open") else "<="
        if lo is not None and hi is not None:
            left, right = ("(" if kw.get("lo_open") else "["), (")" if kw.get("hi_open") else "]")
            text = f"{kind} in {left}{_fmt_number(lo)}, {_fmt_number(hi)}{right}"
        elif lo is not None:
            text = f"{kind} {lo_op} {_fmt_number(lo)}"
        elif hi is not None:
            text = f"{kind} {hi_op} {_fmt_number(hi)}"
        else:
            text = kind
        return text + (" or null" if kw.get("none_ok") else "")
    if base is check_flag:
        return "bool"
    if base is check_path:
        return "path or null"
    if base is check_per_group:
        text = "number >= 0, or a list of them (one per parameter group)"
        return text + (" or null" if kw.get("none_ok") else "")
    if base is check_betas:
        return "[number, number] in [0, 1)"
    if base is parse_choice and check.args:
        return " | ".join(f'`"{m.value}"`' for m in check.args[0])
    enum_cls = next((a for a in (info.annotation, *typing.get_args(info.annotation)) if _is_enum(a)), None)
    if enum_cls is not None:
        return " | ".join(f'`"{m.value}"`' for m in enum_cls)
    return _plain_type(info.annotation)


def _plain_type(annotation: Any) -> str:
    """A type without a validator of ours: ``str or null``, ``"a" | "b"`` (``Literal``), ``str (secret)``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(f'`"{value}"`' for value in args)
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        text = " | ".join(_plain_type(a) for a in args if a is not type(None))
        return text + (" or null" if type(None) in args else "")
    if annotation is SecretStr:
        return "str (secret: not written to checkpoints or logs)"
    return getattr(annotation, "__name__", str(annotation))


def _is_enum(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, enum.Enum)


def _default_of(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def _default_text(cls: type[Section], field: str, info: FieldInfo) -> str:
    declared = declared_key(cls, field).default_text
    if declared is not None:
        return declared
    if _sections_in(info.annotation) and info.default is not None:
        return "(section)"
    value = _default_of(info)
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        return f'`"{value.value}"`'
    if isinstance(value, tuple):
        return f"`[{', '.join(_fmt_number(v) for v in value)}]`"
    if isinstance(value, int) and value >= 10_000 and value != sys.maxsize:
        mantissa, exp = f"{value:e}".split("e")
        short = f"{float(mantissa):g}e{int(exp)}"
        return f"`{value}` ({short})" if float(short) == value else f"`{value}`"
    return f"`{_fmt_number(value)}`"


def _keys_of(cls: type[Section], path: tuple[str, ...], stages: tuple[int, ...]) -> tuple[ConfigKey, ...]:
    keys = []
    for field, info in cls.model_fields.items():
        spellings = cls._ALIASES.get(field, (field,))
        spellings = tuple(dict.fromkeys((*spellings, field)))
        declared = declared_key(cls, field)
        own = tuple(s for s in stages if s in declared.stages)
        keys.append(
            ConfigKey(
                section=path,
                field=field,
                spellings=spellings,
                type=_type_text(info),
                default=_default_of(info),
                default_text=_default_text(cls, field, info),
                stages=own,
                description=_description(cls, field),
                status=declared.status,
            )
        )
    return tuple(keys)


def config_sections() -> list[SectionDoc]:
    """Every section of :class:`ZeroConfig`, depth first, with its keys.

    ``optimizer.params`` appears once per parameter class (Adam / AdamW, SGD).
    """
    docs: list[SectionDoc] = []

    def visit(cls: type[Section], path: tuple[str, ...], title: str, stages: tuple[int, ...]) -> None:
        keys = _keys_of(cls, path, stages)
        docs.append(SectionDoc(path, title, cls, _rst_to_md(_first_paragraph(cls)), keys))
        for key in keys:
            info = cls.model_fields[key.field]
            children = _sections_in(info.annotation)
            kinds: dict[type[Section], list[str]] = {}
            if issubclass(cls, TypedSection) and key.field == "params":
                kinds = cls.params_sections()
                children = list(kinds)
            for child in children:
                child_path = (*path, key.name)
                label = ".".join(child_path)
                if child in kinds:
                    label = f"{label} ({' / '.join(kinds[child])})"
                visit(child, child_path, label, key.stages)

    visit(ZeroConfig, (), "Top level", ALL_STAGES)
    return docs


def config_keys() -> Iterator[ConfigKey]:
    """Every key of every section (see :func:`config_sections`)."""
    for section in config_sections():
        yield from section.keys


# --------------------------------------------------------------------------- markdown


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _stages_text(stages: tuple[int, ...]) -> str:
    return "all" if stages == ALL_STAGES else ", ".join(str(s) for s in stages)


def _status_table(hashes: str) -> list[str]:
    """The keys accepted without effect or not implemented yet, in one table."""
    out = [
        f"{hashes} Keys without effect, and keys not implemented yet",
        "",
        "Accepted and validated; `ignored_keys()` lists the first kind when given, `initialize` refuses "
        "any value but the default of the second.",
        "",
        "| key | status | why |",
        "| --- | --- | --- |",
    ]
    for key in config_keys():
        if isinstance(key.status, Ignored):
            out.append(f"| `{key.path}` | no effect | {_cell(key.status.reason)} |")
        elif isinstance(key.status, Refused):
            out.append(f"| `{key.path}` | not implemented yet | {_cell(key.status.reason)} |")
    return [*out, ""]


def render_markdown(heading_level: int = 2) -> str:
    """The configuration reference as markdown: one table per section, then refused keys."""
    hashes = "#" * heading_level
    out: list[str] = []
    refused: dict[str, str] = {}
    sections = config_sections()
    for section in sections:
        out += [f"{hashes} {'`' + section.title + '`' if section.path else section.title}", ""]
        if section.intro:
            out += [section.intro, ""]
        out += ["| key | type | default | stages | description |", "| --- | --- | --- | --- | --- |"]
        for key in section.keys:
            name = f"`{key.name}`"
            if len(key.spellings) > 1:
                name += " (also " + ", ".join(f"`{s}`" for s in key.spellings[1:]) + ")"
            cells = (name, key.type, key.default_text, _stages_text(key.stages), key.description)
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
        prefix = ".".join(section.path)
        for key, rejected in section.cls.rejected_keys().items():
            refused.setdefault(f"{prefix}.{key}" if prefix else key, _rst_to_md(rejected.reason))
    out += _status_table(hashes)
    out += [
        f"{hashes} Keys that are not accepted",
        "",
        "DeepSpeed keys that zero does not take; the error names the key and says this:",
        "",
        "| key | what to do |",
        "| --- | --- |",
    ]
    out += [f"| `{key}` | {_cell(why)} |" for key, why in sorted(refused.items())]
    out += ["", f"{hashes} DeepSpeed keys without a zero field", ""]
    out += [
        "Accepted by `initialize`: silent when the value changes nothing, otherwise reported once "
        "(rank 0, WARNING), or refused when zero cannot honour the value:",
        "",
        "| key | when given | what zero does |",
        "| --- | --- | --- |",
    ]
    out += [
        f"| `{'.'.join(path)}` | {_known_outcome(known)} | {_cell(known.why)} |"
        for path, known in DEEPSPEED_KEYS.items()
    ]
    out += ["", f"{hashes} Types that are not accepted", "", "| key | type | why, and what to do |"]
    out.append("| --- | --- | --- |")
    for section in sections:
        if issubclass(section.cls, TypedSection):
            path = ".".join((*section.path, "type"))
            refused_types = section.cls.refused_types().items()
            out += [f"| `{path}` | `{kind}` | {_cell(why)} |" for kind, why in refused_types]
    out.append("")
    return "\n".join(out)
