"""Real memory of this rank, read from the process and the accelerator (not from our own counters).

* :func:`read_process_memory` -> :class:`ProcessMemory`: resident set size (RSS) now and its
  peak. On Linux both come from ``/proc/self/status`` (``VmRSS``, ``VmHWM``) and
  :func:`reset_process_peak` resets the peak to the current RSS (writes ``5`` to
  ``/proc/self/clear_refs``), so the peak of one training step can be read. Without
  ``/proc`` (macOS, BSD) the only figure is ``resource.getrusage``'s ``ru_maxrss``: the
  peak since the process started, which cannot be reset, and no current RSS
  (:attr:`ProcessMemory.source` says which).
* :func:`read_device_memory` -> :class:`DeviceMemory` (or ``None`` without an accelerator):
  bytes held by tensors on the current ``torch.accelerator`` device and their peak, through
  the device-generic ``torch.accelerator`` memory API (CUDA, XPU, MPS, ... alike);
  :func:`reset_device_peak` resets that peak.

On CPU, RSS is what the operating system charges the process: the runtime itself (torch
and a gloo process group: about 220 MiB before any model), every live tensor, and whatever
the C allocator keeps after tensors are freed. glibc keeps freed blocks below its mmap
threshold for reuse; start the process with ``MALLOC_MMAP_THRESHOLD_=1048576`` so every
block of 1 MiB or more is returned to the kernel when freed and the RSS follows the live
tensor bytes (benchmarks do).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import sys

import torch

__all__ = [
    "DeviceMemory",
    "MemorySource",
    "ProcessMemory",
    "read_device_memory",
    "read_process_memory",
    "reset_device_peak",
    "reset_process_peak",
]

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"
_CLEAR_PEAK = "5"  # clear_refs command: reset the peak RSS (VmHWM) to the current RSS


class MemorySource(str, enum.Enum):
    """Where a :class:`ProcessMemory` reading comes from."""

    PROC_STATUS = "/proc/self/status"
    """``VmRSS`` and ``VmHWM`` (Linux): RSS now and its peak, resettable per step."""
    GETRUSAGE = "getrusage"
    """``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (no ``/proc``): peak since start only."""


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """One reading of this process's resident memory.

    Attributes:
        rss_bytes: Resident set size now; ``None`` when the source cannot tell (getrusage).
        peak_rss_bytes: Highest RSS since the last :func:`reset_process_peak` (or since the
            process started, when :attr:`peak_resettable` is false).
        source: Where the figures come from.
        peak_resettable: Whether :func:`reset_process_peak` can reset the peak here.
    """

    rss_bytes: int | None
    peak_rss_bytes: int
    source: MemorySource
    peak_resettable: bool


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes held by tensors on one accelerator device (``torch.accelerator`` memory API).

    Attributes:
        device: The device, e.g. ``cuda:0``.
        allocated_bytes: Bytes occupied by live tensors now.
        peak_allocated_bytes: Highest :attr:`allocated_bytes` since the last :func:`reset_device_peak`.
        reserved_bytes: Bytes the caching allocator holds (live tensors + cached free blocks).
    """

    device: str
    allocated_bytes: int
    peak_allocated_bytes: int
    reserved_bytes: int


def _proc_status_kib() -> dict[str, int] | None:
    try:
        with open(_PROC_STATUS, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    found = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE))
    if set(found) != {"VmRSS", "VmHWM"}:
        return None
    return {k: int(v) for k, v in found.items()}


def _max_rss_bytes() -> int:
    import resource  # POSIX only; imported here so that importing this module works everywhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def read_process_memory() -> ProcessMemory:
    """RSS and peak RSS of this process (``/proc/self/status``, else ``getrusage``; see the module doc).

    Raises:
        RuntimeError: neither ``/proc/self/status`` nor ``resource.getrusage`` is available
            (e.g. Windows); the message says so.
    """
    status = _proc_status_kib()
    if status is not None:
        resettable = _clear_refs_writable()
        return ProcessMemory(
            status["VmRSS"] * 1024, status["VmHWM"] * 1024, MemorySource.PROC_STATUS, resettable
        )
    try:
        peak = _max_rss_bytes()
    except ImportError as exc:
        raise RuntimeError(
            "cannot read this process's memory: no /proc/self/status and no resource.getrusage on "
            f"{sys.platform}; measure memory with the operating system's own tools"
        ) from exc
    return ProcessMemory(None, peak, MemorySource.GETRUSAGE, False)


def _clear_refs_writable() -> bool:
    return os.access(_PROC_CLEAR_REFS, os.W_OK)


def reset_process_peak() -> bool:
    """Reset the peak RSS (``VmHWM``) to the current RSS; ``False`` when it cannot be reset here.

    Writes ``5`` to ``/proc/self/clear_refs`` (Linux). Without it (no ``/proc``, or a kernel
    that refuses) the peak stays the peak since the process started.
    """
    try:
        with open(_PROC_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write(_CLEAR_PEAK)
    except OSError:
        return False
    return True


def _accelerator() -> torch.device | None:
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator()


def read_device_memory() -> DeviceMemory | None:
    """Memory of the current accelerator device, or ``None`` when there is no accelerator (CPU)."""
    accel = _accelerator()
    if accel is None:
        return None
    index = torch.accelerator.current_device_index()
    return DeviceMemory(
        device=f"{accel.type}:{index}",
        allocated_bytes=torch.accelerator.memory_allocated(index),
        peak_allocated_bytes=torch.accelerator.max_memory_allocated(index),
        reserved_bytes=torch.accelerator.memory_reserved(index),
    )


def reset_device_peak() -> bool:
    """Reset the current accelerator device's peak allocated bytes; ``False`` without an accelerator."""
    if _accelerator() is None:
        return False
    torch.accelerator.reset_peak_memory_stats(torch.accelerator.current_device_index())
    return True
