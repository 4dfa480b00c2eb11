"""Adjacent runs: tensors that lie back to back in one storage, handled with one op per run.

The reduced partitions of a coalesced reduce-scatter are views into one flat buffer, and an
optimizer's gradient partitions are usually views into one flat gradient buffer too. Where
both lie back to back, the partitions are added with one ``add_`` per run of adjacent
destinations instead of one per tensor (:func:`add_in_runs`); each element still receives
exactly the one addition it would have received alone, so the results are bit-identical.

Partitions reduced on an accelerator and added into host memory (an offloaded optimizer's
gradients) land through a :class:`HostLanding`: every copy is issued ``non_blocking`` into
pinned memory first, the host waits once, then adds, instead of a blocking copy into pageable
memory per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch

from zero_comm.coalesced import adjacent_flat_view
from zero_comm.streams import AcceleratorStreamSource, StreamSource

__all__ = ["GradPartitions", "HostLanding", "add_in_runs", "adjacent_runs", "in_fewer_runs"]

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


class HostLanding:
    """Adds of parts into targets: same-device adds at once, device parts into host targets
    staged (copied ``non_blocking`` into pinned memory) and added after one wait in :meth:`finish`.

    Args:
        source: The stream the staging copies are ordered on (``None``: the current stream of
            the first staged part's accelerator; a test double on CPU).
        pin: Whether staging memory is pinned (staged parts are on an accelerator; a CPU test
            double passes ``False``).
    """

    __slots__ = ("_pending", "pin", "source")

    def __init__(self, source: StreamSource | None = None, pin: bool = True) -> None:
        self.source = source
        self.pin = pin
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, target: torch.Tensor, part: torch.Tensor) -> None:
        """``target += part``: now where both share a device, at :meth:`finish` for a device
        part into a host target, now through a blocking copy otherwise."""
        if part.device == target.device:
            target.add_(part)
        elif target.device.type == "cpu":
            self.stage(target, part)
        else:
            target.add_(part.to(target.device))

    def stage(self, target: torch.Tensor, part: torch.Tensor) -> None:
        """Issue ``part``'s copy into (pinned) host memory; :meth:`finish` adds it into ``target``."""
        if self.source is None:
            self.source = AcceleratorStreamSource(part.device)
        staging = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=self.pin)
        staging.copy_(part, non_blocking=self.pin)
        self._pending.append((target, staging))

    def finish(self) -> None:
        """Wait once for every staged copy, then add each into its target on the host."""
        if not self._pending or self.source is None:  # (a source is set by the first stage)
            return
        self.source.current_stream().record_event().synchronize()
        for target, staging in self._pending:
            target.add_(staging)
        self._pending.clear()


def add_in_runs(targets: Sequence[torch.Tensor], parts: Sequence[torch.Tensor], runs: Sequence[Run]) -> None:
    """``targets[i] += parts[i]`` for every ``i``: one ``add_`` per run where both sides lie back to back.

    ``runs`` are :func:`adjacent_runs` of ``targets``; a run whose ``parts`` are not adjacent
    too (or differ in size) is added tensor by tensor. ``parts`` on an accelerator added into
    host ``targets`` land through one :class:`HostLanding` (pinned, ``non_blocking``, one wait).
    Every element gets the same single addition either way: the results are bit-identical to a
    loop of ``add_``.
    """
    landing = HostLanding()
    for a, b in runs:
        dst, src = adjacent_flat_view(targets[a:b]), adjacent_flat_view(parts[a:b])
        if dst is not None and src is not None and dst.numel() == src.numel():
            landing.add(dst, src)
            continue
        for target, part in zip(targets[a:b], parts[a:b], strict=True):
            landing.add(target, part)
    landing.finish()
