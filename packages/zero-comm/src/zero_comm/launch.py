"""Deprecated: the local launcher is the zero-launch package (``from zero_launch import launch``).

Its names stay reachable here, each with a :class:`DeprecationWarning` naming its new home.
"""

from __future__ import annotations

import warnings
from typing import Any

import zero_launch

__all__ = list(zero_launch.__all__)


def __getattr__(name: str) -> Any:
    if name in zero_launch.__all__:
        warnings.warn(
            f"zero_comm.launch.{name} moved to the zero-launch package: import it from zero_launch",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(zero_launch, name)
    raise AttributeError(f"module 'zero_comm.launch' has no attribute {name!r}")
