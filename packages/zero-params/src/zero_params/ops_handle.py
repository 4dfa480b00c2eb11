"""The handle of a call that issued several collectives: waiting it waits each of them in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["OpsHandle"]


class _Op(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class OpsHandle:
    """The collectives one call issued; ``wait()`` completes them (waiting twice is a no-op)."""

    __slots__ = ("_ops",)

    def __init__(self, ops: Sequence[_Op]) -> None:
        self._ops = ops

    def __repr__(self) -> str:
        return f"{type(self).__name__}(collectives={len(self._ops)}, completed={self.is_completed()})"

    def wait(self) -> None:
        """Block until every collective of this handle completed and its results are in place."""
        for op in self._ops:
            op.wait()

    def is_completed(self) -> bool:
        """Whether ``wait()`` would not block on communication."""
        return all(op.is_completed() for op in self._ops)
