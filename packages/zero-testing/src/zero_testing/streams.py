"""A recording double of device streams and events, for ``zero_comm.CommStreams`` on CPU.

:class:`RecordingStreamSource` is a ``zero_comm.StreamSource``: its streams log every
``record_event``, ``wait_event``, ``wait_stream`` and ``synchronize``, and it logs every
switch of the current stream, into one shared :attr:`log` of tuples, e.g.
``("record", "gather", "gather#3")``, ``("wait_event", "compute", "gather#3")``,
``("enter", "reduce")``. Tests append their own entries (a collective, a use) to the same
log and assert on the order.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RecordingEvent", "RecordingStream", "RecordingStreamSource"]


class RecordingEvent:
    """An event: only its name (``<stream>#<n>``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"RecordingEvent({self.name!r})"


class RecordingStream:
    """A stream that logs what is asked of it."""

    __slots__ = ("_count", "log", "name")

    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.log = log
        self._count = 0

    def __repr__(self) -> str:
        return f"RecordingStream({self.name!r})"

    def record_event(self, event: RecordingEvent | None = None) -> RecordingEvent:
        self._count += 1
        event = event or RecordingEvent(f"{self.name}#{self._count}")
        self.log.append(("record", self.name, event.name))
        return event

    def wait_event(self, event: RecordingEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, stream: RecordingStream) -> None:
        self.log.append(("wait_stream", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class RecordingStreamSource:
    """Streams named ``names`` in creation order (``gather``, then ``reduce`` for ``CommStreams``)
    and a ``compute`` stream current at the start.

    Attributes:
        log: Every logged call, in order.
        compute: The compute stream.
        current: The stream work is issued on now.
    """

    def __init__(self, names: tuple[str, ...] = ("gather", "reduce")) -> None:
        self.log: list[tuple[Any, ...]] = []
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
