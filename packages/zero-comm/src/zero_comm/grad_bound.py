"""The inf / nan check that rides on the gradient reduce-scatter: no collective of its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zero_comm.coalesced import adjacent_flat_view
from zero_comm.profiling import profile_range

__all__ = ["BOUNDED_DTYPES", "GradientBound"]

BOUNDED_DTYPES = (torch.float32, torch.bfloat16)
"""Gradient dtypes whose range makes a false overflow of the summed maxima implausible."""


class GradientBound:
    """The summed sidebands of every reduction since the gradients were last zeroed (one per optimizer).

    Args:
        world: Ranks the reduce-scatter runs over (the sideband has one element each).
    """

    __slots__ = ("_sum", "world")

    def __init__(self, world: int) -> None:
        if world < 1:
            raise ValueError(f"GradientBound: world must be >= 1, got {world}")
        self.world = world
        self._sum: torch.Tensor | None = None

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
