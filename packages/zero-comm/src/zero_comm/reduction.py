"""Reduction operators accepted by zero-comm collectives (``"sum"``, ``"avg"``, ...)."""

from __future__ import annotations

import enum

import torch.distributed as dist

__all__ = ["Reduction", "ReduceOpLike"]


class Reduction(enum.Enum):
    """A reduction, accepted as this enum, its string value or the matching ``dist.ReduceOp``."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"

    @classmethod
    def parse(cls, op: ReduceOpLike, allowed: tuple[Reduction, ...], what: str) -> Reduction:
        """Normalise ``op`` and check that ``what`` supports it.

        Raises:
            ValueError: ``op`` is unknown or not in ``allowed``; the message lists the accepted values.
        """
        found: Reduction | None = None
        if isinstance(op, Reduction):
            found = op
        elif isinstance(op, str):
            found = next((r for r in cls if r.value == op.lower()), None)
        else:
            found = next((r for r in cls if op == r.torch_op), None)
        if found is None or found not in allowed:
            names = ", ".join(repr(r.value) for r in allowed)
            raise ValueError(f"{what}: unsupported reduction {op!r}; use one of {names}")
        return found

    @property
    def torch_op(self) -> dist.ReduceOp:
        """The ``torch.distributed.ReduceOp`` of this reduction."""
        return getattr(dist.ReduceOp, self.name)


ReduceOpLike = Reduction | str | dist.ReduceOp
