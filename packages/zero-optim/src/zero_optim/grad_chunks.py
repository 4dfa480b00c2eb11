"""A flat gradient partition held in chunks that are freed between optimizer steps: :class:`GradChunks`.

A :class:`~zero_optim.flat.FlatGroup` normally holds its fp32 gradient partition as one flat
tensor for its whole life. Stage 3 instead holds it as chunks, each a run of segments that
one reduce bucket fills: after a step the chunks are freed (the gradient is not needed until
the next backward), and each chunk is made again, zeroed, when its bucket's first reduction
adds into it. A rank at rest then holds no gradient, and backward brings the partition back
one bucket at a time, as FSDP2 frees and re-makes its sharded gradients. Within a chunk the
segments lie back to back, so a bucket's reduced partitions are still added with one ``add_``.

A reduction in flight only needs its chunk when it lands: :meth:`GradChunks.reserve` makes a
chunk without filling it (``RESERVED``), and it is zero-filled (``LIVE``) by the first
:meth:`~GradChunks.view`, :meth:`~GradChunks.tensors` or :meth:`~GradChunks.pieces` after,
which the reduction calls just before adding into it. Its pages are thus first written when
the reduction lands, not while the bucket is in flight.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator, Sequence

import torch

from zero_optim.segment import Segment

__all__ = ["ChunkState", "GradChunks"]


class ChunkState(enum.Enum):
    """Where one chunk stands between two optimizer steps."""

    RELEASED = enum.auto()
    """Freed: reads as zeros; made again on first use."""
    RESERVED = enum.auto()
    """Made, not yet filled: zero-filled on first use (a reduction in flight will add into it)."""
    LIVE = enum.auto()
    """Made and holding the gradient accumulated so far."""


class GradChunks:
    """The fp32 gradient partition of a flat group's ``segments`` in chunks; a freed chunk reads as zeros.

    Args:
        segments: The group's segments, in flat order.
        starts: Index of the first segment of each chunk (``0`` first, increasing).
        device: Where the chunks are made.
    """

    __slots__ = ("_chunk_of", "_chunks", "_device", "_offsets", "_sizes", "_states", "_views", "segments")

    def __init__(self, segments: Sequence[Segment], starts: Sequence[int], device: torch.device) -> None:
        starts = list(starts)
        if segments and (
            not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= len(segments)
        ):
            raise ValueError(
                f"chunk starts {starts} are not increasing segment indices from 0 of {len(segments)}"
            )
        self.segments = tuple(segments)
        self._device = device
        ends = [*starts[1:], len(segments)]
        self._offsets = [segments[a].offset for a in starts]
        self._sizes = [sum(s.numel for s in segments[a:b]) for a, b in zip(starts, ends)]
        self._chunk_of = [c for c, (a, b) in enumerate(zip(starts, ends)) for _ in range(a, b)]
        self._chunks: list[torch.Tensor | None] = [None] * len(starts)
        self._states = [ChunkState.RELEASED] * len(starts)
        self._views: list[torch.Tensor | None] = [None] * len(segments)

    @property
    def released(self) -> bool:
        """Whether some chunk is freed (it reads as zeros until made again)."""
        return ChunkState.RELEASED in self._states

    def state(self, i: int) -> ChunkState:
        """The state of segment ``i``'s chunk."""
        return self._states[self._chunk_of[i]]

    def view(self, i: int) -> torch.Tensor:
        """Segment ``i``'s 1-D fp32 gradient partition, its chunk ``LIVE`` (the same tensor until freed)."""
        self._chunk(self._chunk_of[i])
        return self.reserve(i)

    def reserve(self, i: int) -> torch.Tensor:
        """Segment ``i``'s view, its chunk made but not filled if it was released (``RESERVED``).

        Only for a writer that calls :meth:`view` (which fills it) before it adds into the view.
        """
        view = self._views[i]
        if view is None:
            c = self._chunk_of[i]
            chunk = self._chunks[c]
            if chunk is None:
                chunk = self._chunks[c] = torch.empty(
                    self._sizes[c], dtype=torch.float32, device=self._device
                )
                self._states[c] = ChunkState.RESERVED
            seg = self.segments[i]
            view = self._views[i] = chunk.narrow(0, seg.offset - self._offsets[c], seg.numel)
        return view

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every non-empty chunk, freed ones made again (zeroed)."""
        return tuple(self._chunk(c) for c, size in enumerate(self._sizes) if size)

    def made(self) -> list[torch.Tensor]:
        """The chunks not freed (nothing is made or filled)."""
        return [c for c in self._chunks if c is not None]

    def zero_(self) -> None:
        """Zero every chunk not freed (``LIVE`` from now on)."""
        made = self.made()
        if made:
            torch._foreach_zero_(made)
        self._states = [ChunkState.RELEASED if c is None else ChunkState.LIVE for c in self._chunks]

    def release(self) -> None:
        """Free every chunk (and the segment views into them)."""
        self._chunks = [None] * len(self._chunks)
        self._states = [ChunkState.RELEASED] * len(self._chunks)
        self._views = [None] * len(self._views)

    def pieces(self, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(offset, gradient piece)`` covering flat elements ``[start, stop)``, one per chunk, in order."""
        first = max(bisect.bisect_right(self._offsets, start) - 1, 0)
        for c in range(first, len(self._offsets)):
            lo, size = self._offsets[c], self._sizes[c]
            if lo >= stop:
                break
            a, b = max(start, lo), min(stop, lo + size)
            if b > a:
                yield a, self._chunk(c).narrow(0, a - lo, b - a)

    def _chunk(self, c: int) -> torch.Tensor:
        """Chunk ``c``, ``LIVE``: made zeroed if released, zero-filled if reserved."""
        chunk = self._chunks[c]
        if chunk is None:
            chunk = self._chunks[c] = torch.zeros(self._sizes[c], dtype=torch.float32, device=self._device)
        elif self._states[c] is ChunkState.RESERVED:
            chunk.zero_()
        self._states[c] = ChunkState.LIVE
        return chunk
