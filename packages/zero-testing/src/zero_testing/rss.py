"""Resident memory of this process, for tests that measure real memory (Linux ``/proc`` only).

The tests' own reading, independent of the library's (``zero_full.memory.rank_memory``): ``VmRSS``
(resident now) and ``VmHWM`` (its peak) from ``/proc/self/status``, and the peak reset to the
current RSS by writing ``5`` to ``/proc/self/clear_refs``. Run the measured process with
``MALLOC_MMAP_THRESHOLD_=1048576`` so freed tensors of 1 MiB or more leave the RSS.

:func:`rest_and_peak` is the measurement the fresh-process memory tests share: after warm-up
steps, the resident bytes above a baseline taken before the model was built, then the peak above
that baseline during one more step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["RestAndPeak", "peak_bytes", "reset_peak", "resident_bytes", "rest_and_peak"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_bytes(key: str) -> int:
    with open(_STATUS, encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in {_STATUS}: these memory tests need Linux")


def resident_bytes() -> int:
    """``VmRSS``: this process's resident set size now, in bytes."""
    return _status_bytes("VmRSS")


def peak_bytes() -> int:
    """``VmHWM``: the highest resident set size since the process started or :func:`reset_peak`."""
    return _status_bytes("VmHWM")


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``).

    Raises:
        OSError: the kernel refuses the write (the peak could not be reset; the test cannot measure).
    """
    with open(_CLEAR_REFS, "w", encoding="ascii") as f:
        f.write("5")


@dataclasses.dataclass(frozen=True)
class RestAndPeak:
    """Resident bytes above a baseline.

    Attributes:
        rest: Between steps after the warm-up (the state the process keeps between steps: the
            lowest of a few readings at step boundaries).
        peak: The highest during one more step, the peak reset just before it.
    """

    rest: int
    peak: int


def rest_and_peak(
    step: Callable[[], object], baseline: int, warmup: int = 2, readings: int = 3
) -> RestAndPeak:
    """Run ``step`` ``warmup`` times, read the RSS at rest, then the peak of one more ``step``."""
    if warmup < 1 or readings < 1:
        raise ValueError(f"rest_and_peak needs warmup >= 1 and readings >= 1, got {warmup}, {readings}")
    for _ in range(warmup):
        step()
    rests = [resident_bytes()]
    for _ in range(readings - 1):
        step()
        rests.append(resident_bytes())
    rest = min(rests) - baseline
    reset_peak()
    step()
    return RestAndPeak(rest=rest, peak=peak_bytes() - baseline)
