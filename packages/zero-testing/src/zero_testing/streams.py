"""Recording doubles of a device's streams and events, for code that orders work on streams.

A CPU has no streams or events torch can record, so that code is tested on a CPU with these
doubles: every call appends a tuple to one shared log, e.g. ``("record", "gather", "gather#3")``
(stream, event), ``("wait_event", "compute", "gather#3")``, ``("wait_stream", "side",
"compute")``, ``("enter", "side")`` / ``("exit", "side")`` (a ``with stream:`` block, or a
switch of :class:`RecordingStreamSource`'s current stream), ``("synchronize", "e1")``. Tests
append their own entries (a collective, a copy, a use) to the same log and assert on the order.
:class:`RecordingStreamSource` is a ``zero_comm.StreamSource``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RecordingEvent", "RecordingStream", "RecordingStreamSource"]


class RecordingEvent:
    """An event (``torch.Event``'s ``record`` / ``synchronize``) named ``name``, logging on ``log``."""

    __slots__ = ("log", "name")

    def __init__(self, name: str, log: list[tuple[Any, ...]] | None = None) -> None:
        self.name = name
        self.log = log if log is not None else []

    def __repr__(self) -> str:
        return f"RecordingEvent({self.name!r})"

    def record(self, stream: RecordingStream) -> None:
        self.log.append(("record", stream.name, self.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class RecordingStream:
    """A stream that logs what is asked of it."""

    __slots__ = ("_count", "log", "name")

    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.log = log
        self._count = 0

    def __repr__(self) -> str:
        return f"RecordingStream({self.name!r})"

    def __enter__(self) -> RecordingStream:
        self.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append(("exit", self.name))

    def record_event(self, event: RecordingEvent | None = None) -> RecordingEvent:
        self._count += 1
        event = event or RecordingEvent(f"{self.name}#{self._count}", self.log)
        event.record(self)
        return event

    def wait_event(self, event: RecordingEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, stream: RecordingStream) -> None:
        self.log.append(("wait_stream", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class RecordingStreamSource:
    """Streams named ``names`` in creation order (``gather``, then ``reduce`` for ``CommStreams``)
    and a ``compute`` stream current at the start, logging on ``log`` (a new list if not given).

    Attributes:
        log: Every logged call, in order.
        compute: The compute stream.
        current: The stream work is issued on now.
    """

    def __init__(
        self, names: tuple[str, ...] = ("gather", "reduce"), log: list[tuple[Any, ...]] | None = None
    ) -> None:
        self.log: list[tuple[Any, ...]] = log if log is not None else []
        self.compute = RecordingStream("compute", self.log)
        self.current = self.compute
        self._names = list(names)

    def current_stream(self) -> RecordingStream:
        return self.current

    def set_stream(self, stream: RecordingStream) -> None:
        self.log.append(("enter", stream.name))
        self.current = stream

    def new_stream(self) -> RecordingStream:
        if not self._names:
            raise RuntimeError("RecordingStreamSource: more streams asked for than names given")
        return RecordingStream(self._names.pop(0), self.log)
