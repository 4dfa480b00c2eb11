"""The inf / nan check that rides on the gradient reduce-scatter: no collective of its own.

A caller hands the bound its gradients and gets their reduced partitions back: the sideband is
attached and taken off here, on the way down and up (:class:`BoundedReduceScatter`, the
strategy form; :meth:`GradientBound.reduce_in_place` and :meth:`~GradientBound.issue_staged`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from zero_comm.coalesced import adjacent_flat_view
from zero_comm.handles import ReduceScatterHandle
from zero_comm.in_place import reduce_scatter_in_place
from zero_comm.profiling import profile_range
from zero_comm.reduction import ReduceOpLike
from zero_comm.staged import StagedReduceScatter
from zero_comm.strategies import AllToAllReduceScatter, OnGroup

__all__ = ["BOUNDED_DTYPES", "BoundedReduceScatter", "GradientBound"]

BOUNDED_DTYPES = (torch.float32, torch.bfloat16)
"""Gradient dtypes whose range makes a false overflow of the summed maxima implausible."""


class GradientBound:
    """The summed sidebands of every reduction since the gradients were last zeroed (one per optimizer).

    Args:
        world: Ranks the reduce-scatter runs over (the sideband has one element each).
    """

    __slots__ = ("_riding", "_sum", "world")

    def __init__(self, world: int) -> None:
        if world < 1:
            raise ValueError(f"GradientBound: world must be >= 1, got {world}")
        self.world = world
        self._sum: torch.Tensor | None = None
        self._riding: dict[int, BoundedReduceScatter] = {}

    def sideband(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """``world`` copies of ``max |g|`` over ``grads`` (their dtype), to reduce right beside them.

        Raises:
            ValueError: ``grads`` is empty.
        """
        if not grads:
            raise ValueError("GradientBound.sideband needs the bucket's gradients, got none")
        with profile_range("zero.optim.grad_bound"), torch.no_grad():
            # regions of one flat buffer, in either order, are scanned as one tensor
            flat = adjacent_flat_view(grads)
            flat = flat if flat is not None else adjacent_flat_view(grads[::-1])
            scanned = grads if flat is None else [flat]
            extremes = [e for g in scanned if g.numel() for e in torch.aminmax(g)]
            first = grads[0]
            if not extremes:
                return torch.zeros(self.world, dtype=first.dtype, device=first.device)
            peak = torch.stack(extremes).abs().amax()
            return peak.reshape(1).expand(self.world).contiguous()

    def carried(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` and their :meth:`sideband` last: what the reduce-scatter sends (``grads`` if empty)."""
        return [*grads, self.sideband(grads)] if grads else list(grads)

    def split(self, reduced: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The reduced partitions of a :meth:`carried` call: the sideband's (last) is :meth:`received`."""
        if not reduced:
            return reduced
        self.received(reduced[-1])
        return reduced[:-1]

    def riding(self, strategy: AllToAllReduceScatter, what: str = "the gradient") -> BoundedReduceScatter:
        """``BoundedReduceScatter(strategy, self, what)``, made once per strategy (a gradient hook
        asks for it at every reduction)."""
        found = self._riding.get(id(strategy))
        if found is None or found.inner is not strategy:
            found = self._riding[id(strategy)] = BoundedReduceScatter(strategy, self, what)
        return found

    def reduce_in_place(
        self, regions: Sequence[torch.Tensor], group: ProcessGroup | None, *, op: ReduceOpLike = "avg"
    ) -> ReduceScatterHandle:
        """:func:`~zero_comm.reduce_scatter_in_place` of ``regions`` with their sideband (async)."""
        return reduce_scatter_in_place(self.carried(regions), group, op=op, async_op=True).then(self.split)

    def issue_staged(
        self, staging: StagedReduceScatter, count: int, *, op: ReduceOpLike = "avg"
    ) -> ReduceScatterHandle:
        """Issue ``staging``, whose first ``count`` tensors are gradients and whose last is the
        sideband's slot (``world`` elements), after scanning the staged rows (async).

        Tensors never put are reduced as zeros and scanned as such. ``wait()`` returns the
        gradients' partitions.
        """
        staging.fill_missing(count)
        staging.put(count, self.sideband(staging.staged_rows(count)))
        return staging.issue(op=op, async_op=True).then(self.split)

    def received(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced sideband element (a 1-element tensor) to the running sum."""
        with profile_range("zero.optim.grad_bound"), torch.no_grad():
            if self._sum is None:  # a copy: the reduced element lies in the collective's buffer
                self._sum = reduced.reshape(()).to(torch.float32, copy=True)
            else:
                self._sum.add_(reduced.reshape(()))

    def nonfinite(self) -> bool:
        """Whether any rank's gradients reduced since :meth:`reset` may hold an inf or nan (all ranks agree).

        One read of a scalar (a device sync), no collective. ``False`` when nothing was reduced.
        """
        if self._sum is None:
            return False
        with profile_range("zero.optim.overflow_check"):
            return not bool(torch.isfinite(self._sum))

    def reset(self) -> None:
        """The gradients were zeroed: the next reductions start a new sum (no kernel runs)."""
        self._sum = None


class BoundedReduceScatter(OnGroup):
    """The plain reduce-scatter strategy with a :class:`GradientBound` riding on it.

    A :class:`~zero_comm.ReduceScatterStrategy`: ``reduce_scatter_coalesced(grads)`` returns the
    gradients' partitions, and every call adds its sideband to ``bound``.

    Args:
        inner: The reduce-scatter the gradients go through.
        bound: The running sum every call adds to.
        what: Names the gradients in the error (for example the first parameter's name).

    Raises:
        ValueError: ``inner`` is not the plain :class:`~zero_comm.AllToAllReduceScatter` over
            ``bound.world`` ranks (other strategies change or regroup the elements they send).
    """

    __slots__ = ("bound", "inner")

    def __init__(
        self, inner: AllToAllReduceScatter, bound: GradientBound, what: str = "the gradient"
    ) -> None:
        if type(inner) is not AllToAllReduceScatter or inner.group_size != bound.world:
            raise ValueError(
                f"{what} is reduced by {type(inner).__name__} over {inner.group_size} ranks; a "
                f"GradientBound rides only on the plain AllToAllReduceScatter over {bound.world}: "
                "build the optimizer without it"
            )
        super().__init__(inner.group)
        self.inner = inner
        self.bound = bound

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], *, op: ReduceOpLike = "avg", async_op: bool = False
    ) -> ReduceScatterHandle:
        """The inner strategy's reduce-scatter of ``tensors`` and their sideband; ``wait()``
        returns the partitions of ``tensors`` only."""
        carried = self.bound.carried(tensors)
        return self.inner.reduce_scatter_coalesced(carried, op=op, async_op=async_op).then(self.bound.split)
