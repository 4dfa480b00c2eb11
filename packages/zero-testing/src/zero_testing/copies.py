"""A log of ``Tensor.copy_`` calls, beside :mod:`zero_testing.streams`' stream doubles.

Under :class:`CopyLog` every copy appends ``("copy", numel, non_blocking)`` to the log the
stream doubles write to, so a test asserts on copies and stream calls in one order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CopyLog"]


class CopyLog(TorchFunctionMode):
    """While active, logs every ``Tensor.copy_`` as ``("copy", numel, non_blocking)``."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            self.log.append(("copy", args[0].numel(), bool(kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)
