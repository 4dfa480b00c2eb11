"""What ``initialize`` does with ``config=``: a DeepSpeed config taken as DeepSpeed takes it.

:func:`prepare_config` reads the config (a dict or a JSON file), applies
:func:`~zero_full.config.compat.accept_deepspeed` (DeepSpeed keys without a zero field, unknown
keys), fills in ``"auto"`` values (:func:`~zero_full.config.auto.resolve_auto`), validates the
result into a :class:`~zero_full.config.ZeroConfig`, sizes the ``zero_optimization`` sizes left
unset from the model (:func:`~zero_full.config.sizing.size_defaults`), and returns it with one
report of every key that did not simply take effect (the engine's ignored keys included), which
the engine logs once.
:func:`validate_deepspeed` does the same without a model: ``"auto"`` values are left to
``initialize`` (reported), the rest is validated.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from torch import nn

from zero_full.config.auto import resolve_auto
from zero_full.config.compat import ConfigReport, Finding, FindingKind, accept_deepspeed, is_auto
from zero_full.config.sizing import size_defaults
from zero_full.config.zero_config import ZeroConfig

__all__ = ["ConfigLike", "key_findings", "log_config_report", "prepare_config", "validate_deepspeed"]

ConfigLike = ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None


def _raw(config: ConfigLike) -> dict[str, Any] | None:
    if config is None or isinstance(config, ZeroConfig):
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, str | os.PathLike):
        return ZeroConfig.read_json(config)
    raise TypeError(
        f"config must be a ZeroConfig, a dict or a path to a JSON file, got {type(config).__name__}"
    )


def key_findings(config: ZeroConfig) -> ConfigReport:
    """The keys of a validated config that have no effect with it (``ZeroConfig.key_report``)."""
    report = config.key_report()
    return ConfigReport(
        tuple(Finding(f.path, f.value, FindingKind.IGNORED, f.reason) for f in report.ignored)
    )


def _drop_autos(node: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in node.items():
        if is_auto(value) or (isinstance(value, list) and any(is_auto(v) for v in value)):
            continue
        out[key] = _drop_autos(value) if isinstance(value, dict) else value
    return out


def validate_deepspeed(config: ConfigLike, *, strict: bool = False) -> tuple[ZeroConfig, ConfigReport]:
    """Validate a DeepSpeed config without a model (``"auto"`` values reported, left to ``initialize``).

    Raises:
        zero_full.config.compat.ConfigError: values zero cannot honour (or unknown keys, ``strict``).
        pydantic.ValidationError: invalid values of the keys zero takes.
    """
    raw = _raw(config)
    if raw is None:
        cfg = ZeroConfig.coerce(config)
        return cfg, key_findings(cfg)
    clean, report = accept_deepspeed(raw, ZeroConfig, strict=strict)
    without = _drop_autos(clean)
    try:
        cfg = ZeroConfig.model_validate(without)
    except ValidationError as exc:
        # a required key given as "auto" (a schedule's step counts): a stand-in of 1 checks the rest
        autos = {tuple(f.path.split(".")) for f in report.of_kind(FindingKind.AUTO)}
        missing = [e["loc"] for e in exc.errors() if e["type"] == "missing"]
        if not missing or not all(tuple(map(str, loc)) in autos for loc in missing):
            raise
        for loc in missing:
            node = without
            for part in loc[:-1]:
                node = node[part]
            node[loc[-1]] = 1
        cfg = ZeroConfig.model_validate(without)
    return cfg, report + key_findings(cfg)


def prepare_config(
    config: ConfigLike, model: nn.Module, world_size: int, *, strict: bool = False
) -> tuple[ZeroConfig, ConfigReport]:
    """The config ``initialize`` runs with, and the report of every key that did not simply take effect.

    Args:
        config: A ``ZeroConfig`` (used as is), a DeepSpeed-style dict, a path to a JSON file, or None.
        model: The model (for ``"auto"`` sizes).
        world_size: The data-parallel world size (for ``"auto"`` batch keys).
        strict: Keys neither zero nor DeepSpeed knows are an error instead of reported.

    Raises:
        zero_full.config.compat.ConfigError: values zero cannot honour, ``"auto"`` values it
            cannot derive (or unknown keys, ``strict``), each named.
        pydantic.ValidationError: invalid values of the keys zero takes.
    """
    raw = _raw(config)
    if raw is None:
        cfg = ZeroConfig.coerce(config)
        sized_cfg, sized = size_defaults(cfg, model)
        return sized_cfg, key_findings(cfg) + sized
    clean, report = accept_deepspeed(raw, ZeroConfig, strict=strict)
    resolved, filled = resolve_auto(clean, model, world_size)
    cfg = ZeroConfig.model_validate(resolved)
    kept = ConfigReport(tuple(f for f in report.findings if f.kind is not FindingKind.AUTO))
    sized_cfg, sized = size_defaults(cfg, model)
    return sized_cfg, kept + filled + key_findings(cfg) + sized


def log_config_report(report: ConfigReport, logger: logging.Logger) -> None:
    """Log ``report`` once (call it on rank 0 only): the sizes chosen from the model in one INFO
    line, every other finding at WARNING in one table."""
    sized = report.of_kind(FindingKind.SIZED)
    if sized:
        logger.info(
            "zero: sizes left unset, chosen from the model: %s (%s)",
            ", ".join(f"{f.path.rpartition('.')[2]}={f.value_text()}" for f in sized),
            sized[0].why.partition(": ")[2],
        )
    rest = ConfigReport(tuple(f for f in report.findings if f.kind is not FindingKind.SIZED))
    if rest.findings:
        logger.warning(
            "zero: %d config keys did not simply take effect (unknown keys may be typos):\n%s",
            len(rest.findings),
            rest.table(),
        )
