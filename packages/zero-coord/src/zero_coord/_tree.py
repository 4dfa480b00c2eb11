"""Find and replace the grad-requiring tensors of nested module inputs and outputs.

Traverses tensors, named tuples, tuples, lists, dicts (including ``OrderedDict`` and
``transformers.ModelOutput``) and dataclasses; anything else is left alone (its tensors get
no backward hooks, exactly like FSDP2). Both functions walk in the same order.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["collect_grad_tensors", "replace_grad_tensors"]

_MAX_DEPTH = 32


def _is_namedtuple(x: object) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def collect_grad_tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """Append every tensor of ``obj`` that requires grad to ``out`` (and return ``out``)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif depth >= _MAX_DEPTH:
        return out
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            collect_grad_tensors(item, out, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            collect_grad_tensors(item, out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            if field.init:
                collect_grad_tensors(getattr(obj, field.name), out, depth + 1)
    return out


def replace_grad_tensors(obj: Any, new: Iterator[torch.Tensor], depth: int = 0) -> Any:
    """Rebuild ``obj`` with its grad-requiring tensors taken, in order, from ``new``.

    Containers are rebuilt, never mutated, except dict subclasses that cannot be built from
    a plain dict: those are shallow-copied and updated item by item.
    """
    if isinstance(obj, torch.Tensor):
        return next(new) if obj.requires_grad else obj
    if depth >= _MAX_DEPTH:
        return obj
    if _is_namedtuple(obj):
        return type(obj)(*(replace_grad_tensors(item, new, depth + 1) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(replace_grad_tensors(item, new, depth + 1) for item in obj)
    if isinstance(obj, dict):
        values = {key: replace_grad_tensors(value, new, depth + 1) for key, value in obj.items()}
        if type(obj) is dict:
            return values
        rebuilt = copy.copy(obj)
        for key, value in values.items():
            rebuilt[key] = value
        return rebuilt
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: replace_grad_tensors(getattr(obj, f.name), new, depth + 1)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj
