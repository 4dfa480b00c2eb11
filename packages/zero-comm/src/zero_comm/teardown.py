"""Bounded collectives: a job whose collective failed still exits.

A collective that zero gave up on (:class:`~zero_comm.CollectiveTimeoutError`) stays queued in
the communication library: gloo's worker thread keeps waiting for the peer, and the process
group's destructor — at ``destroy_process_group()`` or at interpreter exit — waits for that
thread. Under gloo's default timeout (30 minutes) a rank that raised therefore did not exit
until its stuck or stopped peer woke, and the launcher never saw the failure.

:class:`BoundedTimeouts` bounds the library's own timeout of every process group alive when
it is applied (gloo backends: ``backend.set_timeout``) to the watchdog's ``comm_timeout`` plus
a margin, for as long as it is held: a collective issued meanwhile either completes or fails
within that bound, so after zero raised the process exits (and ``destroy_process_group()``
returns) at most that long after the collective was issued. :meth:`BoundedTimeouts.close`
restores the previous timeouts (collectives already issued keep their bound).

Backends without a settable timeout (NCCL keeps its own watchdog and abort) are left alone.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from zero_comm.closing import ClosesOnExit

__all__ = ["BoundedTimeouts", "bound_for"]


def bound_for(comm_timeout: float, heartbeat_interval: float) -> float:
    """The library timeout that lets the watchdog diagnose first: ``comm_timeout`` plus a margin."""
    return float(comm_timeout) + 2.0 * float(heartbeat_interval) + 2.0


class BoundedTimeouts(ClosesOnExit):
    """Holds every live gloo process group's timeout at ``seconds`` until :meth:`close`.

    Args:
        seconds: The bound (see :func:`bound_for`).

    Call :meth:`cover` again after creating process groups (sub-groups of MiCS, hpZ) so they
    are bounded too; :meth:`close` is idempotent.
    """

    __slots__ = ("_previous", "seconds")

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"BoundedTimeouts: seconds must be > 0, got {seconds}")
        self.seconds = float(seconds)
        self._previous: list[tuple[Any, datetime.timedelta]] = []
        self.cover()

    def __repr__(self) -> str:
        return f"BoundedTimeouts(seconds={self.seconds:g}, backends={len(self._previous)})"

    @property
    def backends(self) -> int:
        """How many backends are bounded now."""
        return len(self._previous)

    def cover(self) -> None:
        """Bound every live process group's gloo backend not bounded yet."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        held = {id(b) for b, _ in self._previous}
        bound = datetime.timedelta(seconds=self.seconds)
        for backend in _gloo_backends():
            if id(backend) in held:
                continue
            previous = backend.options._timeout
            backend.set_timeout(min(previous, bound))
            self._previous.append((backend, previous))
            held.add(id(backend))

    def close(self) -> None:
        """Restore each bounded backend's previous timeout (for collectives issued from now on)."""
        previous, self._previous = self._previous, []
        for backend, timeout in previous:
            try:
                backend.set_timeout(timeout)
            except RuntimeError:  # the group was destroyed meanwhile
                pass


def _gloo_backends() -> list[Any]:
    """The gloo backend of every registered process group (the default one first)."""
    groups = list(getattr(dist.distributed_c10d._world, "pg_names", {}))
    found = []
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cpu"))
        except RuntimeError:
            continue
        if isinstance(backend, dist.ProcessGroupGloo) and hasattr(backend, "set_timeout"):
            found.append(backend)
    return found
