"""Where an offloaded optimizer's tensors live, and how they cross between device and host.

ZeRO-Offload keeps the fp32 master, the fp32 gradient partition and the optimizer's moments
in host memory and only the working (low-precision) parameters on the accelerator. Three
small objects say how, each chosen once and used by every host buffer and copy of the
offload path:

* :class:`HostMemory`: how host buffers are allocated, page-locked (pinned) or plain.
  Pinned only where an accelerator exists (:func:`host_memory`): pinning needs one, and
  only pinned memory lets a copy to or from the device run asynchronously.
* :class:`CopyStream`: where host -> device copies run. :class:`SideStream` issues them
  ``non_blocking`` on a side stream of the accelerator (zero-comm's ``StreamSource``, as for
  its gather and reduce streams),
  so they overlap the host's optimizer step; :meth:`CopyStream.join` makes the compute
  stream wait for them before anything reads the parameters, :meth:`CopyStream.settle` the
  host before the next step writes their sources. :class:`Inline` (CPU) copies
  in place, blocking, and joins nothing. This seam is local to the offload path.
* :class:`HostPlacement`: the engine's device with the two above; :attr:`HostPlacement.split`
  says whether master and gradient partition live on the host apart from the device (an
  accelerator), or stay where they are (the device is the host: nothing changes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from zero_comm.streams import AcceleratorStreamSource, StreamSource, run_on

__all__ = [
    "CopyStream",
    "HostMemory",
    "HostPlacement",
    "Inline",
    "SideStream",
    "copy_stream_for",
    "host_memory",
    "host_placement",
]

_HOST = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """How the offload path allocates host buffers: pinned (page-locked) or plain."""

    pinned: bool = False

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised 1-D host tensor."""
        return torch.empty(numel, dtype=dtype, device=_HOST, pin_memory=self.pinned)

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero-filled 1-D host tensor."""
        return self.empty(numel, dtype).zero_()

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (same shape and dtype)."""
        return self.empty(tensor.numel(), tensor.dtype).view(tensor.shape).copy_(tensor)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def host_memory(pin_memory: bool) -> HostMemory:
    """Pinned host memory when ``pin_memory`` is asked for and an accelerator exists; else plain."""
    return HostMemory(pinned=bool(pin_memory) and torch.accelerator.is_available())


class CopyStream(Protocol):
    """Host -> device copies of updated parameters, and the point where the device waits for them."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, issued so that it may overlap the host's work."""
        ...

    def join(self) -> None:
        """Make the compute stream wait for every copy issued so far (before the parameters are read)."""
        ...

    def settle(self) -> None:
        """Make the host wait for every joined copy (before it writes their sources again)."""
        ...


class Inline:
    """The CPU's copies: done in place, blocking; nothing to join."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy now."""
        dst.copy_(src)

    def join(self) -> None:
        """Nothing is in flight."""

    def settle(self) -> None:
        """Nothing is in flight."""


class SideStream:
    """Copies ``non_blocking`` on a side stream, joined to the compute stream by an event.

    The streams come from a ``zero_comm.StreamSource``, the seam :class:`zero_comm.CommStreams`
    orders its gathers and reductions through (the accelerator's, or a recording double). The
    side stream first waits for the compute stream (the destination may still be read there);
    :meth:`join` records an event on the side stream and makes the compute stream wait for it.
    The host buffers stay alive and unchanged until the next step, which starts after the host
    passed :meth:`settle`.
    """

    __slots__ = ("_issued", "_last", "_source", "stream")

    def __init__(self, source: StreamSource) -> None:
        needed = ("new_stream", "current_stream", "set_stream")
        if not all(callable(getattr(source, m, None)) for m in needed):
            raise TypeError(
                f"SideStream(source) needs a zero_comm.StreamSource (new_stream, current_stream, set_stream; "
                f"on an accelerator: zero_comm.AcceleratorStreamSource(device)), got {type(source).__name__}"
            )
        self._source = source
        self.stream = source.new_stream()
        self._issued = False
        self._last: Any = None

    def __repr__(self) -> str:
        return f"SideStream({self.stream!r})"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue ``dst.copy_(src, non_blocking=True)`` on the side stream."""
        if not self._issued:
            self.stream.wait_stream(self._source.current_stream())
            self._issued = True
        run_on(self._source, self.stream, lambda: dst.copy_(src, non_blocking=True))

    def join(self) -> None:
        """The compute stream waits for the copies issued since the last join."""
        if not self._issued:
            return
        event = self.stream.record_event()
        self._source.current_stream().wait_event(event)
        self._issued = False
        self._last = event

    def settle(self) -> None:
        """The host waits for the copies of the last :meth:`join` (their host sources may change next)."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None


def copy_stream_for(device: torch.device) -> CopyStream:
    """:class:`SideStream` for an accelerator ``device``, :class:`Inline` for the host."""
    return Inline() if device.type in ("cpu", "meta") else SideStream(AcceleratorStreamSource(device))


@dataclasses.dataclass(frozen=True)
class HostPlacement:
    """The engine's ``device`` and how the offload path uses host memory next to it.

    Attributes:
        device: Where the working parameters (and the model) live.
        memory: How host buffers are allocated.
        copies: How updated parameters travel from host to device.
        split: Whether the fp32 master and gradient partition live on the host, apart from
            ``device`` (``device`` is an accelerator). Tests set it on a CPU to run the data flow.
    """

    device: torch.device
    memory: HostMemory
    copies: CopyStream
    split: bool

    @property
    def master_device(self) -> torch.device:
        """Where the fp32 master and the fp32 gradient partition live."""
        return _HOST if self.split else self.device


def host_placement(device: torch.device, pin_memory: bool) -> HostPlacement:
    """The placement of an optimizer offloaded from ``device`` (split when it is not the host)."""
    split = device.type not in ("cpu", "meta")
    return HostPlacement(device, host_memory(pin_memory), copy_stream_for(device), split)
