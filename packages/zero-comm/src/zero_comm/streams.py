"""Side streams for gathers and reduce-scatters, ordered with events: :class:`CommStreams`.

On an accelerator, packing, casts and the collectives of a gather run on a *gather* stream
and those of a gradient reduce-scatter on a *reduce* stream, so a prefetched gather overlaps
the compute of the module before it. The ordering follows FSDP2 and never calls
``record_stream``:

- a gather: the gather stream waits on the compute stream (the shards and any memory it
  reuses are final), the gather is issued on it and its event recorded; the compute stream
  waits on that event before the gathered parameter is used or freed. Memory the gather
  stream allocates is reused only by later gathers, which wait on the compute stream first.
- a reduce-scatter: a *grad-ready* event is recorded on the compute stream and waited by
  the reduce stream; the reduce is issued on it and its event recorded. The gradients it
  reads stay referenced until the compute stream has waited on that event (at most
  ``keep`` reductions in flight, and all at the end of backward), and the optimizer step
  runs after the compute stream waited on the last reduce event.

:func:`comm_streams` chooses once per engine: :class:`CommStreams` on torch's device-generic
API (``torch.Stream``, ``torch.accelerator``) when the parameters live on the accelerator
and the process group serves it, :data:`NO_STREAMS` (nothing to order: every call a no-op)
otherwise. The stream source is a seam (:class:`StreamSource`), so the order of calls is
tested on CPU with a recording double.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from zero_comm.devices import served_device_types
from zero_comm.profiling import profile_range

__all__ = [
    "NO_STREAMS",
    "AcceleratorStreamSource",
    "CommStreams",
    "NoStreams",
    "StreamSource",
    "comm_streams",
]

H = TypeVar("H")


class StreamSource(Protocol):
    """Where :class:`CommStreams` gets its streams: torch's accelerator API, or a test double.

    The streams it returns have ``record_event()``, ``wait_event(event)`` and
    ``wait_stream(stream)`` (as ``torch.Stream``).
    """

    def current_stream(self) -> Any:
        """The stream work is issued on now (the compute stream outside :class:`CommStreams`)."""
        ...

    def set_stream(self, stream: Any) -> None:
        """Issue work on ``stream`` from now on."""
        ...

    def new_stream(self) -> Any:
        """A new stream of the device."""
        ...


class AcceleratorStreamSource:
    """:class:`StreamSource` of the current accelerator through ``torch.accelerator``.

    Args:
        device: The accelerator device the parameters live on.
    """

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def set_stream(self, stream: torch.Stream) -> None:
        torch.accelerator.set_stream(stream)

    def new_stream(self) -> torch.Stream:
        return torch.Stream(device=self.device)


def run_on(source: StreamSource, stream: Any, work: Callable[[], H]) -> H:
    """Run ``work`` with ``stream`` current; the stream current before is restored afterwards."""
    before = source.current_stream()
    source.set_stream(stream)
    try:
        return work()
    finally:
        source.set_stream(before)


class CommStreams:
    """The gather and reduce streams of one engine and the events that order them with compute.

    Args:
        source: Where the streams come from (:class:`AcceleratorStreamSource` on a device).
        keep: Most reductions whose inputs are kept alive before the compute stream waits
            on the oldest (FSDP2's bound on reduce-scatter input buffers).
    """

    __slots__ = ("_pending", "_source", "gather_stream", "keep", "reduce_stream")

    active = True

    def __init__(self, source: StreamSource, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"CommStreams(keep=...) must be an integer >= 1, got {keep!r}")
        self._source = source
        self.keep = keep
        self.gather_stream = source.new_stream()
        self.reduce_stream = source.new_stream()
        # (inputs kept alive, reduce event) per reduction the compute stream has not waited on
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()

    def __repr__(self) -> str:
        return f"CommStreams({self.gather_stream!r}, {self.reduce_stream!r}, keep={self.keep})"

    def gather(self, issue: Callable[[], H]) -> tuple[H, Any]:
        """Run ``issue`` (packs and starts a gather) on the gather stream; returns its result and
        the event the consumer passes to :meth:`wait` before using what it gathered."""
        source = self._source
        compute = source.current_stream()
        stream = self.gather_stream
        with profile_range("zero.comm.streams.gather"):
            stream.wait_stream(compute)
            result = run_on(source, stream, issue)
            return result, stream.record_event()

    def wait(self, event: Any) -> None:
        """The current (compute) stream waits on ``event`` (from :meth:`gather`; ``None``: nothing)."""
        if event is not None:
            self._source.current_stream().wait_event(event)

    def reduce(self, issue: Callable[[], H], inputs: Any) -> H:
        """Run ``issue`` (a reduce-scatter of gradients) on the reduce stream after the gradients
        are ready; ``inputs`` (what it reads) stay referenced until compute waited on it."""
        source = self._source
        compute = source.current_stream()
        stream = self.reduce_stream
        with profile_range("zero.comm.streams.reduce"):
            stream.wait_event(compute.record_event())  # grad-ready
            result = run_on(source, stream, issue)
            pending = self._pending
            pending.append((inputs, stream.record_event()))
            while len(pending) > self.keep:
                compute.wait_event(pending.popleft()[1])
            return result

    def wait_reduced(self) -> None:
        """The compute stream waits on every reduction (before the optimizer step reads the
        partitions); their inputs are released."""
        pending = self._pending
        if pending:
            with profile_range("zero.comm.streams.wait_reduced"):
                self._source.current_stream().wait_event(pending[-1][1])  # later events subsume earlier
                pending.clear()


class NoStreams:
    """Nothing to order (CPU, or a group that does not serve the accelerator): every call runs
    its work on the current stream, or does nothing."""

    __slots__ = ()

    active = False

    def __repr__(self) -> str:
        return "NoStreams()"

    def gather(self, issue: Callable[[], H]) -> tuple[H, None]:
        return issue(), None

    def wait(self, event: Any) -> None:
        pass

    def reduce(self, issue: Callable[[], H], inputs: Any) -> H:
        return issue()

    def wait_reduced(self) -> None:
        pass


NO_STREAMS = NoStreams()
"""The shared :class:`NoStreams` (it has no state)."""


def comm_streams(device: torch.device, group: dist.ProcessGroup | None = None) -> CommStreams | NoStreams:
    """:class:`CommStreams` for parameters on ``device`` when ``device`` is the current
    accelerator and ``group`` (``None``: the default group) serves its type; else :data:`NO_STREAMS`."""
    device = torch.device(device)
    if device.type == "cpu" or not torch.accelerator.is_available():
        return NO_STREAMS
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != device.type:
        return NO_STREAMS
    if device.type not in served_device_types(group):
        return NO_STREAMS
    if device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    return CommStreams(AcceleratorStreamSource(device))
