"""Whether a process exists, by pid: a rank the launcher killed, the writer of a checkpoint lock."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's included: signal 0 only probes).

    Raises:
        ValueError: ``pid`` is not a process id (> 0); 0 and negative values name process groups.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"pid_alive: {pid!r} is not a process id (an integer > 0)")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
