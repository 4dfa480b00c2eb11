"""Profiler ranges that cost nothing when no profiler runs: :func:`profile_range`."""

from __future__ import annotations

import contextlib
from typing import Any

from torch.autograd import _profiler_enabled
from torch.profiler import record_function

__all__ = ["profile_range"]

_NO_RANGE = contextlib.nullcontext()


def profile_range(name: str) -> Any:
    """``record_function(name)`` while a profiler is active, else a shared no-op context.

    An idle ``record_function`` still dispatches an operator on enter and exit, and a stage-3
    step opens several per module and pass; checking for a profiler first is much cheaper.
    """
    return record_function(name) if _profiler_enabled() else _NO_RANGE
