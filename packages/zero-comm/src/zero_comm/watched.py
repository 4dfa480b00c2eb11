"""The hooks between the collectives and the active watchdog.

zero-comm's collectives issue through :func:`watched_call` and wait through :func:`watched_wait`;
the layers above say what the next collectives are for (:func:`note_collectives`, with
:func:`collective_label`) and tell the stage-3 trace's state (:func:`path_diverged`,
:func:`recording_paths`). Each is the plain call, or nothing, when no
:class:`~zero_comm.CommWatchdog` is active: one is active while a :class:`~zero_comm.CommLedger`
that carries it is entered (:func:`activate` / :func:`deactivate`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import Any

from zero_comm.watchdog import CommWatchdog, render_label

__all__ = [
    "activate",
    "active_watchdog",
    "collective_label",
    "deactivate",
    "note_collectives",
    "path_diverged",
    "recording_paths",
    "watched_call",
    "watched_wait",
]

# The one module-level object: it only points at the watchdog active in the current context.
_ACTIVE: contextvars.ContextVar[CommWatchdog | None] = contextvars.ContextVar(
    "zero_comm_watchdog", default=None
)


def collective_label(verb: str, names: Sequence[str], limit: int = 3) -> str:
    """``"gathers `mid`"`` from parameter names (their modules, in order, at most ``limit``)."""
    modules = list(dict.fromkeys(n.rpartition(".")[0] or n for n in names))
    shown = ", ".join(f"`{m}`" for m in modules[:limit])
    more = f" and {len(modules) - limit} more" if len(modules) > limit else ""
    return f"{verb} {shown}{more}"


def activate(watchdog: CommWatchdog) -> contextvars.Token[CommWatchdog | None]:
    """Make ``watchdog`` the active one in this context (what an entered ``CommLedger`` carrying it does).

    Returns:
        The token to pass to :func:`deactivate`, which restores the one active before.
    """
    return _ACTIVE.set(watchdog)


def deactivate(token: contextvars.Token[CommWatchdog | None]) -> None:
    """Restore the watchdog active before the :func:`activate` that returned ``token``."""
    _ACTIVE.reset(token)


def active_watchdog() -> CommWatchdog | None:
    """The active watchdog: the one carried by the innermost entered ledger that has one (``None``: none)."""
    return _ACTIVE.get()


def note_collectives(what: str | Callable[[], str]) -> None:
    """Tell the active watchdog (if any) what the next collectives are for, e.g. ``"gathers `mid`"``."""
    wd = active_watchdog()
    if wd is not None:
        wd.note(what)


def path_diverged(what: str) -> None:
    """Tell the active watchdog (if any) that this rank left its recorded module order.

    See :meth:`CommWatchdog.diverged`; without an active watchdog nothing is checked.
    """
    wd = active_watchdog()
    if wd is not None:
        wd.diverged(what)


def recording_paths(on: bool) -> None:
    """Tell the active watchdog (if any) that a step starts (``True``) or stops recording its module order.

    See :meth:`CommWatchdog.recording`; without an active watchdog nothing is checked.
    """
    wd = active_watchdog()
    if wd is not None:
        wd.recording(on)


def watched_call(
    kind: str, fn: Callable[..., Any], /, *args: Any, async_op: bool = False, **kwargs: Any
) -> Any:
    """Issue ``fn(*args, async_op=..., **kwargs)`` (a ``torch.distributed`` collective).

    Without an active watchdog this is the plain call. With one, the collective is recorded
    and issued asynchronously; a synchronous request waits through the watchdog and returns
    ``None``, as torch does.
    """
    wd = active_watchdog()
    if wd is None:
        return fn(*args, async_op=async_op, **kwargs)
    if wd.broken:
        wd.refuse_if_broken(f"issues a collective ({kind})")
    wd.check_deferred()
    call = wd.issued(kind)
    if wd.paths_checked:
        wd.check_same_path(kind, call, kwargs.get("group"))
    work = fn(*args, async_op=True, **kwargs)
    if wd.timings is not None:
        wd.timings.issued(work, kind, call, render_label(wd.position_label))
    if async_op:
        return work
    wd.wait(work)
    return None


def watched_wait(work: Any) -> bool:
    """Wait for ``work`` through the active watchdog; ``False`` (nothing done) when none is active."""
    wd = active_watchdog()
    if wd is None:
        return False
    wd.wait(work)
    return True
