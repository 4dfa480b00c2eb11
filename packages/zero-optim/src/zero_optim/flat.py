"""Flat buffers of one parameter group: the fp32 master, the fp32 gradient partition, the working copy.

Each parameter of a group owns one :class:`Segment` of this rank's flat partition: the
elements of its partition (a ZeRO-3 shard, padding included) laid out parameter after
parameter. The optimizer state is one flat tensor per kind (e.g. AdamW's ``exp_avg``) over
that layout; per-parameter tensors (shards, gradient partitions) are views into the flat
buffers, so nothing is copied per parameter on the hot path.

The fp32 gradient partition is held one of three ways (:class:`GradLayout`): one flat tensor
``grad``; views into storage another component owns (stage 1's whole gradients); or chunks
freed between optimizer steps and made again, zeroed, on first use
(:class:`~zero_optim.grad_chunks.GradChunks`, stage 3).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from zero_offload import CopyStream, HostMemory
from zero_optim.grad_chunks import GradChunks
from zero_optim.segment import Segment

__all__ = ["FlatGroup", "GradLayout", "Segment"]


class GradLayout(enum.Enum):
    """How a :class:`FlatGroup` holds its fp32 gradient partition."""

    FLAT = enum.auto()
    """One flat tensor (``FlatGroup.grad``) for the group's whole life, zeroed by ``zero_grad``."""
    VIEWS = enum.auto()
    """One view per segment into storage another component owns (``grad_views``)."""
    CHUNKS = enum.auto()
    """Chunks of segments, freed by ``release_grads`` and made again, zeroed, on first use."""


class FlatGroup:
    """The flat buffers of one optimizer parameter group on this rank.

    After :meth:`chunk_grads` the gradient partition is held in chunks (``CHUNKS``):
    :meth:`release_grads` frees them, and :meth:`grad_view`, :meth:`grads` and :meth:`pieces`
    make again (zeroed) the chunks they return. A released partition reads as zeros.
    """

    __slots__ = (
        "_chunks",
        "_copies",
        "_grad_views",
        "_in_params",
        "_offsets",
        "_pieces",
        "_views",
        "grad",
        "master",
        "segments",
        "working",
    )

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        numels: Sequence[int],
        device: torch.device,
        working_dtype: torch.dtype = torch.float32,
        *,
        working_views: Sequence[torch.Tensor] | None = None,
        grad_views: Sequence[torch.Tensor] | None = None,
        host: HostMemory | None = None,
        copies: CopyStream | None = None,
    ) -> None:
        """``host``: the fp32 master and gradient partition live in host memory allocated by it
        (optimizer offload from an accelerator), the working copy on ``device`` (in fp32 too);
        ``copies`` then carries :meth:`publish`'s host -> device copies."""
        if host is not None and (working_views is not None or grad_views is not None):
            raise ValueError("a flat group with a host master allocates its own working and gradient buffers")

        def flat(n: int) -> torch.Tensor:
            return host.zeros(n) if host is not None else torch.zeros(n, dtype=torch.float32, device=device)

        self._copies = copies
        segments: list[Segment] = []
        offset = 0
        for param, name, numel in zip(params, names, numels, strict=True):
            segments.append(Segment(param, name, offset, int(numel)))
            offset += int(numel)
        self.segments: tuple[Segment, ...] = tuple(segments)
        self._offsets = [s.offset for s in self.segments]
        self._pieces: dict[tuple[int, int], tuple[tuple[int, torch.Tensor, torch.Tensor], ...]] = {}
        self._views: tuple[torch.Tensor, ...] | None = None
        if working_views is not None:
            self._views = tuple(working_views)
            for seg, view in zip(self.segments, self._views, strict=True):
                if view.dim() != 1 or view.numel() != seg.numel or view.dtype != working_dtype:
                    raise ValueError(
                        f"working view of {seg.name!r} is {view.dtype} of shape {tuple(view.shape)}, "
                        f"expected 1-D {working_dtype} of {seg.numel} elements"
                    )
        self._chunks: GradChunks | None = None
        self._grad_views: tuple[torch.Tensor, ...] | None = None
        if grad_views is not None:
            self._grad_views = tuple(grad_views)
            for seg, view in zip(self.segments, self._grad_views, strict=True):
                if view.dim() != 1 or view.numel() != seg.numel or view.dtype != torch.float32:
                    raise ValueError(
                        f"gradient view of {seg.name!r} is {view.dtype} of shape {tuple(view.shape)}, "
                        f"expected 1-D float32 of {seg.numel} elements"
                    )
            self.grad = torch.zeros(1, dtype=torch.float32, device=device).expand(offset)
        else:
            self.grad = flat(offset)
        self._in_params = self._views is not None and working_dtype == torch.float32
        if self._in_params:
            self.master = torch.zeros(1, dtype=torch.float32, device=device).expand(offset)
        else:
            self.master = flat(offset)
        self.master.grad = self.grad
        self.working: torch.Tensor | None
        if self._views is not None:
            self.working = None
        elif working_dtype == torch.float32 and host is None:
            self.working = self.master
        else:
            self.working = torch.zeros(offset, dtype=working_dtype, device=device)

    @property
    def numel(self) -> int:
        """Elements of the flat partition (sum of the segments)."""
        return self.master.numel()

    @property
    def grad_layout(self) -> GradLayout:
        """How the gradient partition is held (:class:`GradLayout`)."""
        if self._chunks is not None:
            return GradLayout.CHUNKS
        return GradLayout.VIEWS if self._grad_views is not None else GradLayout.FLAT

    @property
    def grads_released(self) -> bool:
        """Whether some chunk of a ``CHUNKS`` partition is freed (it reads as zeros)."""
        return self._chunks is not None and self._chunks.released

    def chunk_grads(self, starts: Sequence[int]) -> None:
        """Hold the gradient partition in chunks from now on, each from segment ``starts[i]`` on.

        The flat partition is dropped (its values are lost: call it before training) and
        every chunk starts released.

        Raises:
            ValueError: the partition is not ``FLAT``, or ``starts`` are not increasing
                segment indices from 0.
        """
        if self.grad_layout is not GradLayout.FLAT:
            raise ValueError(f"chunk_grads: the gradient partition is {self.grad_layout.name}, not FLAT")
        self._chunks = GradChunks(self.segments, starts, self.grad.device)
        self.grad = torch.zeros(1, dtype=torch.float32, device=self.grad.device).expand(self.numel)
        self.master.grad = self.grad
        self._pieces.clear()

    @property
    def master_in_params(self) -> bool:
        """Whether the fp32 master values are the parameters' own storage (no separate master)."""
        return self._in_params

    def master_view(self, seg: Segment) -> torch.Tensor:
        """The 1-D fp32 master view of one segment (writable: it is where the values live)."""
        if self._in_params:
            return self.working_view(seg)
        return self.master.narrow(0, seg.offset, seg.numel)

    def grad_view(self, seg: Segment) -> torch.Tensor:
        """The 1-D fp32 gradient-partition view of one segment (its chunk made if released)."""
        if self._chunks is not None:
            return self._chunks.view(self._index(seg))
        if self._grad_views is not None:
            return self._grad_views[self._index(seg)]
        return self.grad.narrow(0, seg.offset, seg.numel)

    def grads(self) -> tuple[torch.Tensor, ...]:
        """The gradient partition as writable 1-D fp32 tensors: ``(grad,)``, one per chunk (released
        ones made again, zeroed, so a reader finds the whole partition), or one view per segment."""
        if self._chunks is not None:
            return self._chunks.tensors()
        if self._grad_views is not None:
            return tuple(v for v in self._grad_views if v.numel())
        return (self.grad,) if self.grad.numel() else ()

    def zero_grad(self) -> None:
        """Zero the gradient partition in place (views into it stay valid; released chunks are zeros)."""
        if self._chunks is not None:
            self._chunks.zero_()
            return
        grads = list(self.grads())
        if grads:
            torch._foreach_zero_(grads)

    def reserve_grad(self, seg: Segment) -> torch.Tensor:
        """``CHUNKS``: the segment's gradient view, its chunk made but not zero-filled if released.

        For a reduction in flight that adds into it: the next :meth:`grad_view` of the
        segment (or any reader) zero-fills the chunk, and must come before that addition.

        Raises:
            ValueError: the partition is not ``CHUNKS``.
        """
        if self._chunks is None:
            raise ValueError(f"reserve_grad: the gradient partition is {self.grad_layout.name}, not CHUNKS")
        return self._chunks.reserve(self._index(seg))

    def release_grads(self) -> None:
        """Free a ``CHUNKS`` gradient partition; each chunk is made again, zeroed, on first use.

        Raises:
            ValueError: the partition is not ``CHUNKS`` (nothing this group may free).
        """
        if self._chunks is None:
            raise ValueError(f"release_grads: the gradient partition is {self.grad_layout.name}, not CHUNKS")
        self._chunks.release()
        self._pieces.clear()  # the cached pieces view the freed chunks

    def working_view(self, seg: Segment) -> torch.Tensor:
        """The 1-D working-precision view of one segment (the master view in fp32)."""
        if self._views is not None:
            return self._views[self._index(seg)]
        assert self.working is not None  # noqa: S101 - set whenever there are no views
        return self.working.narrow(0, seg.offset, seg.numel)

    def _index(self, seg: Segment) -> int:
        i = bisect.bisect_right(self._offsets, seg.offset) - 1
        while self.segments[i] is not seg:  # zero-element segments share an offset
            i -= 1
        return i

    def pieces(self, start: int, stop: int) -> tuple[tuple[int, torch.Tensor, torch.Tensor], ...]:
        """``(offset, master piece, gradient piece)`` covering flat elements ``[start, stop)``, in order.

        One piece in the flat layout; one per overlapped segment when the master lives in
        the parameters. The master pieces are writable views of where the values live.
        """
        key = (start, stop)
        found = self._pieces.get(key)
        if found is None:
            found = self._pieces[key] = tuple(self._make_pieces(start, stop))
        return found

    def _make_pieces(self, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        if not self._in_params and self._chunks is not None:
            for off, grad in self._chunks.pieces(start, stop):
                yield off, self.master.narrow(0, off, grad.numel()), grad
            return
        if not self._in_params and self._grad_views is None:
            n = stop - start
            if n > 0:
                yield start, self.master.narrow(0, start, n), self.grad.narrow(0, start, n)
            return
        i = max(bisect.bisect_right(self._offsets, start) - 1, 0)
        for seg in self.segments[i:]:
            if seg.offset >= stop:
                break
            lo, hi = max(start, seg.offset), min(stop, seg.offset + seg.numel)
            if hi > lo:
                a, n = lo - seg.offset, hi - lo
                yield lo, self.master_view(seg).narrow(0, a, n), self.grad_view(seg).narrow(0, a, n)

    def master_copy(self) -> torch.Tensor:
        """A flat fp32 tensor of this rank's master values (the master itself in the flat layout)."""
        if not self._in_params:
            return self.master
        return (
            torch.cat([m for _, m, _ in self.pieces(0, self.numel)]) if self.numel else self.grad.new_zeros(0)
        )

    def load_master(self, values: torch.Tensor) -> None:
        """Copy a flat fp32 tensor of this rank's master values in place, then :meth:`publish`."""
        if values.numel() != self.numel:
            raise ValueError(f"{values.numel()} master values for a flat partition of {self.numel} elements")
        if not self._in_params:
            self.master.copy_(values)
        else:
            flat = values.reshape(-1)
            for off, m, _ in self.pieces(0, self.numel):
                m.copy_(flat.narrow(0, off, m.numel()))
        self.publish()

    def owned_tensors(self) -> Iterator[torch.Tensor]:
        """The tensors holding this group's values (master, gradient partition, flat working copy).

        Placeholders (the master when it lives in the parameters, the flat gradient when the
        gradient partition is a set of views or of chunks) and released chunks are left out:
        they hold no model state. A partition made of views is given as those views, whose
        storage (stage 1's whole gradients) is held whether or not ``param.grad`` is bound to it.
        """
        if not self._in_params:  # else a storage-less placeholder (one element)
            yield self.master
        if self._chunks is not None:
            yield from self._chunks.made()
        elif self._grad_views is None:
            yield self.grad
        else:
            yield from self._grad_views
        if self.working is not None and self.working is not self.master:
            yield self.working

    def publish(self) -> None:
        """Refresh the working copy from the master after a step (nothing to do in fp32)."""
        self.publish_range(0, self.numel)

    def publish_range(self, start: int, stop: int) -> None:
        """Refresh flat elements ``[start, stop)`` of the working copy from the master (none in fp32).

        Lets a step publish each range as soon as the optimizer stepped it
        (:class:`zero_optim.publish.PipelinedPublish`); the copies are those of :meth:`publish`.
        """
        if self._in_params or stop <= start:
            return
        if self._views is not None:
            i = max(bisect.bisect_right(self._offsets, start) - 1, 0)
            for seg, view in zip(self.segments[i:], self._views[i:]):
                if seg.offset >= stop:
                    break
                lo, hi = max(start, seg.offset), min(stop, seg.offset + seg.numel)
                if hi > lo:
                    view.narrow(0, lo - seg.offset, hi - lo).copy_(self.master.narrow(0, lo, hi - lo))
        elif self.working is not None and self.working is not self.master:
            dst = self.working.narrow(0, start, stop - start)
            src = self.master.narrow(0, start, stop - start)
            if self._copies is None:
                dst.copy_(src)
            else:
                self._copies.copy(dst, src)
