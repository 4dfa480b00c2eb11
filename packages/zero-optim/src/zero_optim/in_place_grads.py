"""Stage 1's whole fp32 gradients in one flat buffer, reduced in place: :class:`InPlaceGrads`."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["InPlaceGrads", "RegionState"]


class RegionState(enum.Enum):
    """Where a parameter's gradient region stands in its accumulation window."""

    RELEASED = enum.auto()
    ACCUMULATING = enum.auto()
    REDUCED = enum.auto()


class _Region:
    """One parameter's padded gradient region, its state and the views ``param.grad`` is bound to.

    The views are made once: binding a gradient every step then runs no view operator.
    """

    __slots__ = ("flat", "param", "region", "shaped", "state")

    def __init__(self, param: nn.Parameter, region: torch.Tensor) -> None:
        self.param = param
        self.region = region
        self.flat = region[: param.numel()]
        self.shaped = self.flat.view(param.shape)
        self.state = RegionState.ACCUMULATING


class InPlaceGrads:
    """The whole fp32 gradients of stage 1's parameters, in one flat buffer (see the module docstring).

    Args:
        world: Ranks the gradients are reduce-scattered over.
        rank: This rank's row in every region.
    """

    __slots__ = ("_regions", "rank", "world")

    def __init__(self, world: int, rank: int) -> None:
        self.world = world
        self.rank = rank
        self._regions: dict[int, _Region] = {}

    def allocate(
        self, params: Sequence[nn.Parameter], sizes: Sequence[int], device: torch.device
    ) -> list[torch.Tensor]:
        """Give ``params`` (partition sizes ``sizes``) regions of one new zeroed buffer; their partitions.

        Each ``param.grad`` becomes a view of its region (``ACCUMULATING``: zeros to add to).
        """
        full = torch.zeros(sum(sizes) * self.world, dtype=torch.float32, device=device)
        offset = 0
        for p, size in zip(params, sizes, strict=True):
            region = full.narrow(0, offset, size * self.world)
            entry = self._regions[id(p)] = _Region(p, region)
            p.grad = entry.shaped
            offset += size * self.world
        return [self.partition(p) for p in params]

    def partition(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's row of ``param``'s region: its fp32 gradient partition."""
        region = self._regions[id(param)].region
        size = region.numel() // self.world
        return region.narrow(0, self.rank * size, size)

    def __contains__(self, param: object) -> bool:
        return id(param) in self._regions

    def __bool__(self) -> bool:
        return bool(self._regions)

    def region(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s padded region, holding its whole local gradient, with ``param.grad`` bound to it.

        A ``.grad`` that is not the region's view (autograd's first gradient of a released
        window, or one the user set) is copied in (``None``: zeros) and bound, and the region
        is ``ACCUMULATING``. A ``REDUCED`` region whose ``.grad`` is still bound is returned
        as it is (see :meth:`carry`).
        """
        entry = self._regions[id(param)]
        region, bound, grad = entry.region, entry.flat, param.grad
        if grad is not entry.shaped and (
            grad is None
            or grad.numel() != bound.numel()
            or (bound.numel() and grad.data_ptr() != bound.data_ptr())
        ):
            if grad is None:
                bound.zero_()
            elif grad.shape == entry.shaped.shape:
                entry.shaped.copy_(grad)
            else:
                bound.copy_(grad.reshape(-1))
            param.grad = entry.shaped
            entry.state = RegionState.ACCUMULATING
        elif entry.state is RegionState.RELEASED:  # a view assigned back, no gradient since: stale
            if bound.numel():
                bound.zero_()
            entry.state = RegionState.ACCUMULATING
        return region

    def before_accumulate(self, param: nn.Parameter) -> None:
        """Before autograd adds to a ``.grad`` that is set on a ``RELEASED`` region: bind it first.

        A ``.grad`` set after :meth:`release` (a saved view assigned back, or any tensor) is
        what autograd adds to: its view is zeroed, another tensor is copied in and bound, so the
        sum lands in the region. A ``.grad`` left ``None`` is stolen and copied in afterwards.
        """
        entry = self._regions[id(param)]
        if entry.state is RegionState.RELEASED and param.grad is not None:
            self.region(param)

    def reduced(self, params: Sequence[nn.Parameter]) -> None:
        """Mark the regions of ``params`` reduced: row ``rank`` holds the average."""
        for p in params:
            self._regions[id(p)].state = RegionState.REDUCED

    def carry(self, param: nn.Parameter) -> None:
        """Prepare a ``REDUCED`` region for more gradient in the same window (no-op otherwise).

        The next reduction divides the sum over ranks by the world size, so the average kept
        in row ``rank`` enters that sum multiplied by it; the other rows, which still hold
        this rank's already-reduced local values, are zeroed.
        """
        entry = self._regions[id(param)]
        if entry.state is not RegionState.REDUCED:  # the next gradient is copied in or added as usual
            return
        region = self.region(param)
        if entry.state is not RegionState.REDUCED:  # .grad was replaced: the region was refilled
            return
        size = region.numel() // self.world
        region.narrow(0, self.rank * size, size).mul_(self.world)
        rest = [r for r in _other_rows(region, self.rank, self.world) if r.numel()]
        if rest:
            torch._foreach_zero_(rest)
        entry.state = RegionState.ACCUMULATING

    def release(self, params: Sequence[nn.Parameter]) -> None:
        """``zero_grad`` of ``params``: each ``.grad`` becomes ``None``, each region ``RELEASED``.

        Nothing is written: the first gradient of the next window overwrites the region.
        """
        for p in params:
            self._regions[id(p)].state = RegionState.RELEASED
            p.grad = None

    def zero_released(self) -> None:
        """Zero the partition of every region no reduction wrote since :meth:`release` (before a step).

        An engine reduces every bucket at the accumulation boundary, so normally there is
        none; a step called without one applies zero gradients, as after a zeroing ``zero_grad``.
        """
        rows = [self.partition(e.param) for e in self._regions.values() if e.state is RegionState.RELEASED]
        if rows:
            torch._foreach_zero_(rows)


def _other_rows(region: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    size = region.numel() // world
    return region[: rank * size], region[(rank + 1) * size :]
