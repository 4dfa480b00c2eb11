"""Aligned (and, with an accelerator, pinned) host buffers for swapping.

Direct I/O (``O_DIRECT``) needs the memory address, the length and the file offset to be
multiples of the device's block size; :func:`aligned_empty` returns byte tensors whose data
starts on such a boundary. :class:`BufferPool` holds ``buffer_count`` of them, each
``buffer_bytes`` long, handed out and returned one at a time; its :attr:`BufferPool.resident_bytes`
is what bounds an offloaded optimizer's host memory.
"""

from __future__ import annotations

import threading

import torch

from zero_offload.placement import host_memory

__all__ = ["ALIGNMENT", "BufferPool", "aligned_empty", "align_up"]

ALIGNMENT = 4096
"""Byte alignment of swap buffers, file offsets and direct-I/O lengths (a page; >= any block size)."""


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


def aligned_empty(nbytes: int, *, alignment: int = ALIGNMENT, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised ``uint8`` CPU tensor of ``nbytes`` whose data pointer is ``alignment``-aligned."""
    if nbytes < 0 or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(
            f"aligned_empty needs nbytes >= 0 and a power-of-two alignment, got {nbytes}, {alignment}"
        )
    raw = host_memory(pin_memory).empty(nbytes + alignment, torch.uint8)
    skip = (-raw.data_ptr()) % alignment
    return raw.narrow(0, skip, nbytes)


class BufferPool:
    """``buffer_count`` aligned host buffers of ``buffer_bytes`` each.

    :meth:`acquire` blocks until a buffer is free; :meth:`release` hands it back. The pool
    never grows, so its memory (:attr:`resident_bytes`) is fixed at construction.
    """

    __slots__ = ("_cond", "_free", "buffer_bytes", "buffers")

    def __init__(self, buffer_count: int, buffer_bytes: int, *, pin_memory: bool = False) -> None:
        if buffer_count < 1:
            raise ValueError(f"a buffer pool needs buffer_count >= 1, got {buffer_count}")
        self.buffer_bytes = align_up(max(buffer_bytes, 1))
        self.buffers: tuple[torch.Tensor, ...] = tuple(
            aligned_empty(self.buffer_bytes, pin_memory=pin_memory) for _ in range(buffer_count)
        )
        self._free = list(range(buffer_count))
        self._cond = threading.Condition()

    @property
    def resident_bytes(self) -> int:
        """Host bytes held by the pool (every buffer's storage, alignment slack included)."""
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    @property
    def free_count(self) -> int:
        """Buffers not handed out."""
        with self._cond:
            return len(self._free)

    def acquire(self) -> torch.Tensor:
        """A free buffer (blocks until one is released)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self.buffers[self._free.pop()]

    def release(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` (from :meth:`acquire`) back.

        Raises:
            ValueError: ``buffer`` is not one of this pool's buffers, or it is already free.
        """
        with self._cond:
            for i, b in enumerate(self.buffers):
                if b.data_ptr() == buffer.data_ptr():
                    if i in self._free:
                        raise ValueError(f"buffer {i} released twice")
                    self._free.append(i)
                    self._cond.notify()
                    return
        raise ValueError("released a tensor that is not a buffer of this pool")
