"""Recording doubles of a device's streams and events, and a log of ``Tensor.copy_`` calls.

A CPU has no streams or events torch can record; code that orders copies on an
accelerator's side stream is tested on a CPU by handing it these doubles, which append
what is called to one shared list: ``("wait_stream", stream, other)``, ``("enter", stream)``,
``("exit", stream)``, ``("record", event, stream)``, ``("wait_event", stream, event)``,
``("synchronize", event)`` and
under :class:`CopyLog` ``("copy", numel, non_blocking)``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CopyLog", "RecordingEvent", "RecordingStream", "event_factory"]


class RecordingStream:
    """A stream that logs ``wait_stream``, ``wait_event`` and entering / leaving its context."""

    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: RecordingStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: RecordingEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def __enter__(self) -> RecordingStream:
        self.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append(("exit", self.name))


class RecordingEvent:
    """An event that logs where it is recorded."""

    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: RecordingStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


def event_factory(log: list[tuple[Any, ...]]) -> Any:
    """A callable making :class:`RecordingEvent` s named ``e1``, ``e2``, ... on ``log``."""
    counter = itertools.count(1)
    return lambda: RecordingEvent(log, f"e{next(counter)}")


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
