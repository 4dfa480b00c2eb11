"""The stack's one ``with`` protocol for closable objects: entering returns it, leaving closes it."""

from __future__ import annotations

import abc
from typing import TypeVar

__all__ = ["ClosesOnExit"]

_T = TypeVar("_T", bound="ClosesOnExit")


class ClosesOnExit(abc.ABC):
    """Base of objects released by :meth:`close`: ``with X(...) as x:`` closes ``x`` on leaving,
    whether or not the block raised (exceptions propagate)."""

    __slots__ = ()  # a subclass with slots keeps them

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the object holds."""
