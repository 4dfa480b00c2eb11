"""Waiting for a collective without a timed wait on the backend.

On NCCL, ``work.wait(timeout)`` counts the timeout from the collective's start and, when it
expires, aborts the communicator and rethrows: a wait meant as "check back in two seconds"
kills the job. Gloo throws and carries on. :func:`wait_polled` never passes a timeout to the
backend: it polls ``work.is_completed()`` (non-blocking on every backend), sleeping a little
longer each time, and calls the plain ``work.wait()`` only once the work completed, which then
returns at once or raises the failure the work recorded.

Gloo's timed wait is harmless (it raises "Operation timed out!" and the work carries on):
:func:`wait_timed` blocks in it, woken the moment the work completes, where polling would
add up to a sleep's latency to every small collective.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

__all__ = ["wait_polled", "wait_timed"]

_FIRST_PAUSE = 2e-5
"""Seconds slept after the first poll; doubles up to :data:`_LONGEST_PAUSE`."""

_LONGEST_PAUSE = 5e-4
"""Longest sleep between polls: bounds the latency polling adds to a collective."""


def wait_polled(
    work: Any, every: float, check: Callable[[float], bool] | None = None, *, timeout: float | None = None
) -> bool:
    """Wait until ``work`` completed, calling ``check(waited)`` every ``every`` seconds meanwhile."""
    start = time.monotonic()
    next_check = start + every
    pause = _FIRST_PAUSE
    while not work.is_completed():
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE)
        now = time.monotonic()
        if timeout is not None and now - start >= timeout:
            return False
        if check is not None and now >= next_check:
            next_check = now + every
            check(now - start)
    work.wait()
    return True


def wait_timed(work: Any, every: float, check: Callable[[float], object] | None = None) -> None:
    """Wait until ``work`` completed in timed backend waits of ``every`` seconds, calling
    ``check(waited)`` after each that expired. Only for gloo's works (on NCCL an expired timed
    wait aborts the communicator: use :func:`wait_polled`).
    """
    start = time.monotonic()
    step = datetime.timedelta(seconds=every)
    while True:
        try:
            work.wait(step)
            return
        except RuntimeError:
            if work.is_completed():  # it completed, maybe just now: its own outcome, not the timeout's
                work.wait()
                return
        if check is not None:
            check(time.monotonic() - start)
