"""What an engine holds beyond tensors, and the one way to let it go."""

from __future__ import annotations

import enum
import logging
import weakref
from typing import Any

from zero_comm import BoundedTimeouts, CommWatchdog, bound_for

__all__ = ["EngineResources", "LifecycleState", "track"]

logger = logging.getLogger("zero.engine")


class LifecycleState(enum.Enum):
    """Where an engine's resources are: built, being released, released."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class EngineResources:
    """The watchdog, bounded timeouts and stage pieces of one engine, released together.

    Args:
        watchdog: The collective watchdog (``None``: none; then no timeout is bounded either).
    """

    __slots__ = ("_parts", "state", "timeouts", "watchdog")

    def __init__(self, watchdog: CommWatchdog | None) -> None:
        self.watchdog = watchdog
        self.timeouts: BoundedTimeouts | None = None
        if watchdog is not None:
            self.timeouts = BoundedTimeouts(bound_for(watchdog.timeout, watchdog.heartbeat_interval))
        self._parts: list[Any] = []
        self.state = LifecycleState.OPEN

    def __repr__(self) -> str:
        return f"EngineResources(state={self.state.value}, parts={len(self._parts)})"

    def adopt(self, coordinator: Any, reduction: Any, optimizer: Any) -> None:
        """Take the stage pieces (``None`` where a stage has none) and bound new sub-groups' timeouts."""
        self._parts = [
            (coordinator, "remove"),
            (reduction, "remove"),
            (optimizer, "close"),
        ]
        if self.timeouts is not None:
            self.timeouts.cover()

    def close_quietly(self) -> None:
        """:meth:`close`, logging instead of raising (at interpreter exit, after a failed collective)."""
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nobody can handle it at exit
            logger.debug("zero: releasing the engine at exit: %s", exc)

    def close(self) -> None:
        """Release everything (idempotent); raises the first part's error once all were released."""
        if self.state is not LifecycleState.OPEN:
            return
        self.state = LifecycleState.CLOSING
        first: BaseException | None = None
        steps = [(obj, name) for obj, name in self._parts if obj is not None]
        steps += [(self.watchdog, "close"), (self.timeouts, "close")]
        for obj, name in steps:
            if obj is None:
                continue
            try:
                getattr(obj, name)()
            except Exception as exc:  # noqa: BLE001 - release the rest, then report
                first = first or exc
        self._parts = []
        self.state = LifecycleState.CLOSED
        if first is not None:
            raise first


def track(owner: object, resources: EngineResources) -> weakref.finalize:
    """Close ``resources`` when ``owner`` is collected or, at the latest, at interpreter exit."""
    return weakref.finalize(owner, resources.close_quietly)
