"""Defaults sized from the model: the ``zero_optimization`` sizes a config leaves unset.

DeepSpeed's size defaults (``reduce_bucket_size`` 5e8, ``sub_group_size`` 1e9, ...) are sized for
models of billions of parameters: below that, one bucket, one optimizer sub-group and the
prefetch window each span the whole model, and the step's peak holds several transient copies
of it. When a config leaves these keys unset, ``initialize`` sizes them from the model instead.
With ``L`` the element count of the model's largest parameter (its full shape, also when
``zero.Init`` has partitioned it) and ``u = max(L, 2**20)`` (no bucket below a million elements,
so a model of small tensors keeps few, large collectives), each key takes
``min(factor * u, DeepSpeed's default)``:

* ``reduce_bucket_size``, ``allgather_bucket_size``, ``sub_group_size``: ``u`` (one largest
  layer per gradient bucket, per all-gather bucket, per optimizer sub-group);
* ``stage3_prefetch_bucket_size``, ``stage3_max_reuse_distance``: ``u`` (one layer ahead;
  a layer used again right away, the last one of forward in backward, stays gathered);
* ``stage3_max_live_parameters``: ``2 u`` (the running layer and the prefetched one).

A key given in the config (any value, ``"auto"`` resolved included) keeps its DeepSpeed meaning;
only keys the stage uses are sized, and the values chosen are reported (one INFO line on rank 0).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from zero_full.config.base import declared_key
from zero_full.config.compat import ConfigReport, Finding, FindingKind
from zero_full.config.zero_config import ZeroConfig
from zero_full.config.zero_optimization import ZeroOptimizationConfig
from zero_params import full_shape

__all__ = ["FLOOR", "SIZED_KEYS", "largest_parameter_numel", "size_defaults", "sized_values"]

FLOOR = 1 << 20
"""The smallest size chosen, in elements (a model of small tensors keeps few, large collectives)."""


@dataclasses.dataclass(frozen=True)
class _Rule:
    factor: int
    cap: int  # DeepSpeed's default: a sized value is never larger than it


SIZED_KEYS: dict[str, _Rule] = {
    name: _Rule(factor, ZeroOptimizationConfig.model_fields[name].default)
    for name, factor in (
        ("reduce_bucket_size", 1),
        ("allgather_bucket_size", 1),
        ("sub_group_size", 1),
        ("prefetch_bucket_size", 1),
        ("max_reuse_distance", 1),
        ("max_live_parameters", 2),
    )
}
"""Field -> its rule: ``min(factor * max(L, FLOOR), cap)``."""


def largest_parameter_numel(model: nn.Module) -> int:
    """``L``: elements of the model's largest parameter (full shape, also when partitioned); 0 without any."""
    return max((full_shape(p).numel() for p in model.parameters()), default=0)


def sized_values(largest: int) -> dict[str, int]:
    """Every sized key's value for a model whose largest parameter has ``largest`` elements."""
    unit = max(largest, FLOOR)
    return {name: min(rule.factor * unit, rule.cap) for name, rule in SIZED_KEYS.items()}


def size_defaults(config: ZeroConfig, model: nn.Module) -> tuple[ZeroConfig, ConfigReport]:
    """``config`` with the sized keys it leaves unset (and its stage uses) taken from ``model``.

    Returns:
        The config (``config`` itself when nothing is sized) and one ``SIZED`` finding per key.
    """
    zero = config.zero_optimization
    unset = [
        name
        for name in SIZED_KEYS
        if name not in zero.model_fields_set
        and zero.stage in declared_key(ZeroOptimizationConfig, name).stages
    ]
    largest = largest_parameter_numel(model)
    if not unset or largest == 0:
        return config, ConfigReport()
    values = sized_values(largest)
    sized = {name: values[name] for name in unset}
    why = f"unset: sized from the model's largest parameter ({largest:,} elements)"
    findings = tuple(
        Finding(
            f"zero_optimization.{ZeroOptimizationConfig.documented_key(name)}", value, FindingKind.SIZED, why
        )
        for name, value in sized.items()
    )
    updated = config.model_copy(update={"zero_optimization": zero.model_copy(update=sized)})
    return updated, ConfigReport(findings)
