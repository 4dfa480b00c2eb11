"""Adjacent runs: tensors that lie back to back in one storage, handled with one op per run.

The reduced partitions of a coalesced reduce-scatter are views into one flat buffer, and an
optimizer's gradient partitions are usually views into one flat gradient buffer too. Where
both lie back to back, the partitions are added with one ``add_`` per run of adjacent
destinations instead of one per tensor (:func:`add_in_runs`); each element still receives
exactly the one addition it would have received alone, so the results are bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch

from zero_comm.coalesced import adjacent_flat_view

__all__ = ["GradPartitions", "add_in_runs", "adjacent_runs", "in_fewer_runs"]

Run = tuple[int, int]
"""``[start, stop)`` indices of one run."""

T = TypeVar("T")


class GradPartitions(Protocol):
    """Where each parameter's gradient partition lives (e.g. ``zero_optim.ReplicaPartitioning``)."""

    def grad_partition(self, param: Any, /) -> torch.Tensor:
        """The tensor the reduced partition of ``param`` is added into."""
        ...


def adjacent_runs(tensors: Sequence[torch.Tensor]) -> list[Run]:
    """``[start, stop)`` index runs of ``tensors`` each lying right after the previous in one storage.

    Empty tensors join the run they are in. Judged by storage and offset only, so every rank
    with the same layout finds the same runs (addresses of distinct buffers never matter).
    """
    runs: list[Run] = []
    start, storage, end = 0, None, None
    for i, t in enumerate(tensors):
        if not t.numel():
            continue
        here = t.untyped_storage().data_ptr()
        if end is not None and (here != storage or t.data_ptr() != end):
            runs.append((start, i))
            start = i
        storage, end = here, t.data_ptr() + t.numel() * t.element_size()
    if tensors:
        runs.append((start, len(tensors)))
    return runs


def in_fewer_runs(
    params: Sequence[T], partitions: GradPartitions
) -> tuple[list[T], list[torch.Tensor], list[Run]]:
    """``params``, their gradient partitions and adjacent runs, in the order with fewer runs:
    the given one, the reversed one, or the partitions' order in their storages.
    """
    params = list(params)
    targets = [partitions.grad_partition(p) for p in params]
    best = (params, targets, adjacent_runs(targets))
    if len(best[2]) > 1:
        backwards = adjacent_runs(targets[::-1])
        if len(backwards) < len(best[2]):
            best = (params[::-1], targets[::-1], backwards)
    if len(best[2]) > 1:
        order = sorted(range(len(params)), key=_place_key(targets))
        placed = [targets[i] for i in order]
        runs = adjacent_runs(placed)
        if len(runs) < len(best[2]):
            best = ([params[i] for i in order], placed, runs)
    return best


def _place_key(tensors: Sequence[torch.Tensor]) -> Any:
    """Sort key of an index into ``tensors``: (which storage, first seen first; offset in it; index)."""
    storages: dict[int, int] = {}
    places = []
    for i, t in enumerate(tensors):
        storage = storages.setdefault(t.untyped_storage().data_ptr(), len(storages))
        places.append((storage, t.storage_offset(), i))
    return places.__getitem__


def add_in_runs(targets: Sequence[torch.Tensor], parts: Sequence[torch.Tensor], runs: Sequence[Run]) -> None:
    """``targets[i] += parts[i]`` for every ``i``: one ``add_`` per run where both sides lie back to back.

    ``runs`` are :func:`adjacent_runs` of ``targets``; a run whose ``parts`` are not adjacent
    too (or differ in size) is added tensor by tensor. ``parts`` on another device than their
    targets are moved (one copy per run). Every element gets the same single addition either
    way: the results are bit-identical to a loop of ``add_``.
    """
    for a, b in runs:
        dst, src = adjacent_flat_view(targets[a:b]), adjacent_flat_view(parts[a:b])
        if dst is not None and src is not None and dst.numel() == src.numel():
            dst.add_(src if src.device == dst.device else src.to(dst.device))
            continue
        for target, part in zip(targets[a:b], parts[a:b], strict=True):
            target.add_(part if part.device == target.device else part.to(target.device))
