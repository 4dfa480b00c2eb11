"""Padding arithmetic of ZeRO partitioning.

A tensor of ``numel`` elements is split over ``world`` ranks into equal partitions of
:func:`partition_numel` elements; the last partitions are padded with zeros, so the
padded tensor has :func:`padded_numel` elements. :func:`shard_range` gives the slice of
the *real* (unpadded) elements a rank owns.
"""

from __future__ import annotations

__all__ = ["padded_numel", "partition_numel", "shard_range"]


def _check(numel: int, world: int) -> None:
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world < 1:
        raise ValueError(f"world (the group size) must be >= 1, got {world}")


def partition_numel(numel: int, world: int) -> int:
    """Elements per rank when ``numel`` elements are split over ``world`` ranks."""
    _check(numel, world)
    return -(-numel // world)


def padded_numel(numel: int, world: int) -> int:
    """Size of the zero-padded tensor: ``world * partition_numel(numel, world)``."""
    return world * partition_numel(numel, world)


def shard_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The real elements ``[start, stop)`` that ``rank`` owns, clipped to ``numel``.

    Rank ``rank`` owns padded positions ``[rank * p, (rank + 1) * p)`` with
    ``p = partition_numel(numel, world)``; the part beyond ``numel`` is padding, so
    ``stop - start`` can be smaller than ``p`` (or zero) on the last ranks.
    """
    _check(numel, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the group of {world} ranks (expected 0 <= rank < {world})")
    part = partition_numel(numel, world)
    start = min(rank * part, numel)
    stop = min(start + part, numel)
    return start, stop
