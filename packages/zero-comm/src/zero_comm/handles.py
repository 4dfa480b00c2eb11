"""Handles returned by zero-comm collectives: wait once, finish once."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch

from zero_comm.profiling import profile_range
from zero_comm.watched import watched_wait

__all__ = ["AllGatherHandle", "CollectiveHandle", "ReduceScatterHandle", "TensorHandle"]

T = TypeVar("T")
U = TypeVar("U")


class CollectiveHandle(Generic[T]):
    """An issued collective: the torch ``Work`` (or none) plus a local finishing step.

    :meth:`wait` waits for the communication, runs the finishing step (a copy-out, a
    local reduction, ...) exactly once under ``profile_range("zero.<op>.finish")`` and
    returns its result; later calls return the same result without doing anything.
    """

    __slots__ = ("_finish", "_keepalive", "_result", "_work", "op")

    def __init__(
        self,
        op: str,
        work: Any | None,
        finish: Callable[[], T],
        keepalive: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.op = op
        self._work = work
        self._finish: Callable[[], T] | None = finish
        self._keepalive = keepalive
        self._result: T | None = None

    def __repr__(self) -> str:
        state = "finished" if self._finish is None else ("pending" if self._work else "ready")
        return f"{type(self).__name__}(op={self.op!r}, {state})"

    def wait(self, timeout: timedelta | None = None) -> T:
        """Block until the collective completed and return its result."""
        finish = self._finish
        if finish is None:
            return self._result  # type: ignore[return-value]
        if self._work is not None and (timeout is not None or not watched_wait(self._work)):
            done = self._work.wait() if timeout is None else self._work.wait(timeout)
            if done is False:
                raise TimeoutError(f"{self.op} did not complete within {timeout}")
        with profile_range(f"zero.{self.op}.finish"):
            self._result = finish()
        self._work = None
        self._finish = None
        self._keepalive = ()
        return self._result

    def then(self, fn: Callable[[T], U]) -> CollectiveHandle[U]:
        """A handle of the same type on the same communication whose ``wait()`` returns ``fn(result)``.

        The new handle takes over the pending work: wait on it, not on this one.
        """
        finish = self._finish
        if finish is None:
            done = self._result
            return type(self)(self.op, None, lambda: fn(done))  # type: ignore[arg-type]
        return type(self)(self.op, self._work, lambda: fn(finish()), self._keepalive)  # type: ignore[return-value]

    def is_completed(self) -> bool:
        """True when :meth:`wait` would not block on communication."""
        return self._finish is None or self._work is None or bool(self._work.is_completed())


class AllGatherHandle(CollectiveHandle[list[torch.Tensor]]):
    """Result of an all-gather: ``wait()`` returns one full 1-D tensor per input shard.

    All returned tensors are views into one flat buffer, laid out tensor after tensor.
    """

    __slots__ = ()


class ReduceScatterHandle(CollectiveHandle[list[torch.Tensor]]):
    """Result of a reduce-scatter: ``wait()`` returns this rank's partition of each input.

    All returned tensors are 1-D views into one flat buffer.
    """

    __slots__ = ()


class TensorHandle(CollectiveHandle[torch.Tensor]):
    """Result of a single-tensor collective (all-reduce, broadcast, all-to-all)."""

    __slots__ = ()
