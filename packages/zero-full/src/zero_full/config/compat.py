"""A DeepSpeed config as DeepSpeed takes it: every documented key accepted, the rest reported.

:func:`accept_deepspeed` walks a raw config against the zero sections before validation:

* a key a section declares is kept (``"auto"`` values are set aside for
  :func:`zero_full.config.auto.resolve_auto`, which fills them in at ``initialize``);
* a DeepSpeed key declared in :mod:`zero_full.config.deepspeed_keys` is dropped: silently when
  its value changes nothing, reported otherwise, and refused (one error naming every such key
  and what to do) when zero cannot honour it;
* a key DeepSpeed does not know either (a misspelling, another tool's key) is reported with the
  closest known key, or, with ``strict=True``, is an error.

The findings form one :class:`ConfigReport`, which ``initialize`` logs once, on rank 0, at
WARNING, as a table (key, value, why). ``ZeroConfig.model_validate`` keeps its strict behaviour.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
from collections.abc import Mapping
from typing import Any

from zero_full.config.base import KeyValue, Section
from zero_full.config.deepspeed_keys import DEEPSPEED_KEYS, known_key

__all__ = ["ConfigError", "ConfigReport", "Finding", "FindingKind", "accept_deepspeed", "is_auto"]


class FindingKind(str, enum.Enum):
    """What happened to a key."""

    IGNORED = "ignored"  # a DeepSpeed key or value without effect in zero
    UNKNOWN = "unknown"  # neither zero nor DeepSpeed knows the key
    RESOLVED = "resolved"  # "auto", or a deprecated spelling, given its value
    AUTO = "auto"  # "auto" set aside, resolved at initialize
    SIZED = "sized"  # left unset, sized from the model at initialize (config/sizing.py)


class ConfigError(ValueError):
    """A config zero cannot run as given (every culprit named, with what to do)."""


@dataclasses.dataclass(frozen=True)
class Finding(KeyValue):
    """One reported key: its full path, its value, what became of it and why."""

    kind: FindingKind
    why: str


@dataclasses.dataclass(frozen=True)
class ConfigReport:
    """The keys of a config that did not simply take effect, in the order met."""

    findings: tuple[Finding, ...] = ()

    def __add__(self, other: ConfigReport) -> ConfigReport:
        return ConfigReport(self.findings + other.findings)

    def of_kind(self, kind: FindingKind) -> list[Finding]:
        """The findings of one kind."""
        return [f for f in self.findings if f.kind is kind]

    def table(self) -> str:
        """One table, ``key | value | what | why``; unknown keys first (they may be typos)."""
        order = sorted(self.findings, key=lambda f: f.kind is not FindingKind.UNKNOWN)
        rows = [("key", "value", "what", "why")] + [
            (f.path, f.value_text(), f.kind.value, f.why) for f in order
        ]
        widths = [min(max(len(r[i]) for r in rows), 60) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
            for row in rows
        )


def is_auto(value: Any) -> bool:
    """Whether ``value`` is the Hugging Face placeholder ``"auto"`` (any case)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


@dataclasses.dataclass
class _Walk:
    strict: bool
    findings: list[Finding] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    unknown: list[str] = dataclasses.field(default_factory=list)

    def section(self, cls: type[Section], data: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        clean: dict[str, Any] = {}
        rewrites = []
        for key, value in data.items():
            where = (*path, str(key))
            dotted = ".".join(where)
            if isinstance(key, str) and cls._canonical_name(key) is not None:
                if is_auto(value) or (isinstance(value, list) and any(is_auto(v) for v in value)):
                    self.findings.append(Finding(dotted, value, FindingKind.AUTO, "filled in at initialize"))
                    clean[key] = value
                    continue
                child = cls._child_section(key, data)
                if child is not None and isinstance(value, Mapping):
                    value = self.section(child, value, where)
                clean[key] = value
                continue
            known = known_key(_generic(where))
            if known is not None:
                if known.refuses(value):
                    self.refused.append(f"{dotted} = {json.dumps(value, default=str)}: {known.why}")
                elif known.rewrite is not None and not known.silent(value):
                    rewrites.append((known, value))
                    self.findings.append(Finding(dotted, value, FindingKind.RESOLVED, known.why))
                elif not known.silent(value):
                    self.findings.append(Finding(dotted, value, FindingKind.IGNORED, known.why))
                continue
            self._unknown(cls, where, value)
        for known, value in rewrites:
            known.rewrite(clean, value)  # type: ignore[misc]
        return clean

    def _unknown(self, cls: type[Section], where: tuple[str, ...], value: Any) -> None:
        here = _generic(where)[:-1]
        candidates = cls.accepted_keys() + [p[-1] for p in DEEPSPEED_KEYS if p[:-1] == here]
        rejected = cls.rejected_keys().get(where[-1])
        close = difflib.get_close_matches(where[-1], candidates, n=1, cutoff=0.6)
        if rejected is not None:
            why = rejected.reason
        elif close:
            why = f"not a DeepSpeed key; did you mean {'.'.join((*where[:-1], close[0]))!r}?"
        else:
            why = "not a DeepSpeed key (DeepSpeed ignores it too)"
        self.findings.append(Finding(".".join(where), value, FindingKind.UNKNOWN, why))
        self.unknown.append(f"{'.'.join(where)}: {why}")


def _generic(path: tuple[str, ...]) -> tuple[str, ...]:
    """The declaration path of ``path`` (``bfloat16`` is ``bf16``)."""
    return tuple("bf16" if p == "bfloat16" and i == 0 else p for i, p in enumerate(path))


def accept_deepspeed(
    raw: Mapping[str, Any], root: type[Section], *, strict: bool = False
) -> tuple[dict[str, Any], ConfigReport]:
    """The part of ``raw`` the zero sections validate, and what became of the rest.

    Args:
        raw: A DeepSpeed-style config dict.
        root: The top section (``ZeroConfig``).
        strict: Unknown keys are an error (as ``ZeroConfig.model_validate`` makes them).

    Returns:
        The cleaned dict (``"auto"`` values still in it) and the report.

    Raises:
        ConfigError: values zero cannot honour, or (``strict``) unknown keys, all named at once.
    """
    walk = _Walk(strict)
    clean = walk.section(root, raw, ())
    problems = list(walk.refused)
    if strict:
        problems += [f"unknown key {u}" for u in walk.unknown]
    if problems:
        lines = "\n  - ".join(problems)
        raise ConfigError(f"this config asks for what zero cannot do:\n  - {lines}")
    return clean, ConfigReport(tuple(walk.findings))
