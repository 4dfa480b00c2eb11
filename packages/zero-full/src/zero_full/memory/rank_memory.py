"""Real memory of this rank, read from the process and the accelerator (not from our own counters)."""

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
    "reset_peak_memory",
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
    """One reading of this process's resident memory."""

    rss_bytes: int | None
    peak_rss_bytes: int
    source: MemorySource
    peak_resettable: bool


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes held by tensors on one accelerator device (``torch.accelerator`` memory API)."""

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


def reset_peak_memory() -> bool:
    """Reset the process's peak RSS and the accelerator's peak; whether the process peak was reset."""
    reset_device_peak()
    return reset_process_peak()
