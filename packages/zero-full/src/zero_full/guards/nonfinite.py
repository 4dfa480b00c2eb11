"""Non-finite gradients in fp32 and bf16: detected at the step, skipped or raised, never silent.

fp16 has its loss scaler (an overflow skips the step and lowers the scale). In fp32 and bf16
an inf / nan gradient on one rank would otherwise turn every weight on every rank into nan.
:class:`NonFiniteGuard` decides, with the same answer on every rank:

* with ``gradient_clipping`` the global norm is computed anyway (one all-reduce of the
  squared sums): a non-finite norm means some gradient is non-finite, no extra pass;
* without clipping, stages 1, 2 and 3 (not MiCS) in fp32 / bf16 with the plain reduce-scatter
  read the bound their gradient reduce-scatter carried (``zero_comm.GradientBound``: no
  collective of its own);
* otherwise one all-reduce (max) of a local inf/nan flag (``zero_optim.found_overflow``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from zero_comm import GradientBound
from zero_full.config.robustness import NonFinitePolicy
from zero_full.guards.agreement import exchange_json
from zero_optim import PartitionedOptimizer, found_overflow

__all__ = ["NonFiniteGradientError", "NonFiniteGuard"]

logger = logging.getLogger("zero.engine")


class NonFiniteGradientError(FloatingPointError):
    """Some rank's gradients held an inf or nan (``robustness.nonfinite_gradients = "raise"``)."""


class NonFiniteGuard:
    """The fp32 / bf16 non-finite gradient check and its policy."""

    __slots__ = ("group", "policy", "skipped_steps")

    def __init__(self, policy: NonFinitePolicy, group: ProcessGroup | None = None) -> None:
        self.policy = policy
        self.group = group
        self.skipped_steps = 0

    def flag_without_norm(self, optimizer: PartitionedOptimizer, bound: GradientBound | None = None) -> bool:
        """Whether any rank's gradients are non-finite (no clipping).

        From ``bound`` when the gradient reduction carried one (every rank reads the same sum),
        else one all-reduce of a flag.
        """
        if bound is not None:
            return bound.nonfinite()
        return found_overflow(optimizer.groups, self.group)

    def handle(
        self, optimizer: PartitionedOptimizer, step: int, *, overflowed: str = "the gradient norm"
    ) -> None:
        """The global check fired: find and name the culprit, then skip (count, warn) or raise.

        Collective: every rank calls it after the same global answer.
        """
        with record_function("zero.optim.nonfinite_scan"):
            local = _first_nonfinite(optimizer)
            found = exchange_json(local, self.group) if dist.is_initialized() else [local]
        ranks = _global_ranks(self.group, len(found))
        culprits = [(ranks[i], name) for i, name in enumerate(found) if name]
        if culprits:
            where = ", ".join(f"`{name}` on rank {r}" for r, name in culprits)
            what = f"non-finite gradient (inf/nan) at optimizer step {step + 1}: first in {where}"
        else:
            what = (
                f"non-finite gradient check at optimizer step {step + 1}: no element is inf/nan, but "
                f"{overflowed} overflowed"
            )
        if self.policy is NonFinitePolicy.RAISE:
            raise NonFiniteGradientError(
                f"{what}. Every rank raised (robustness.nonfinite_gradients = 'raise'); check the data and "
                "the learning rate, or set it to 'skip' to skip such steps"
            )
        self.skipped_steps += 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(
                "zero: %s; step skipped on every rank (robustness.nonfinite_gradients = 'skip', %d skipped "
                "so far)",
                what,
                self.skipped_steps,
            )


def _global_ranks(group: ProcessGroup | None, size: int) -> list[int]:
    if group is None or not dist.is_initialized():
        return list(range(size))
    return list(dist.get_process_group_ranks(group))


def _first_nonfinite(optimizer: PartitionedOptimizer) -> str:
    """This rank's first parameter (in flat order) whose gradient partition is non-finite, or ``""``."""
    for group in optimizer.groups:
        if all(bool(torch.isfinite(g).all()) for g in group.grads()):
            continue
        for g, seg in optimizer.segments():
            if g is group:
                part = group.grad_view(seg)
                if part.numel() and not bool(torch.isfinite(part).all()):
                    return seg.name
    return ""
