"""Which device a process group serves: where control-plane tensors must live.

A process group carries tensors only of the device types it has a backend for: a group made
by ``init_process_group("nccl")`` serves ``cuda`` alone, so a CPU tensor in one of its
collectives raises ``No backend type associated with device type cpu``. Every small exchange
zero makes for itself (rank agreement, the watchdog's path check, the non-finite exchange,
checkpoint statuses) builds its tensors on :func:`control_device` of the group it uses.
:func:`default_store` is the default group's store (where the watchdog heartbeats).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["control_device", "default_store", "served_device_types"]

# Device types of the backends torch ships, for groups that do not list their own.
_BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu", "cuda"), "xccl": ("xpu",)}


def served_device_types(group: dist.ProcessGroup | None = None) -> tuple[str, ...]:
    """Device types ``group`` (``None``: the default group) has a backend for, e.g. ``("cuda",)``.

    ``("cpu",)`` when ``torch.distributed`` is not initialised (nothing to serve: the caller
    makes no collective).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ("cpu",)
    pg = group if group is not None else dist.group.WORLD
    listed = getattr(pg, "_device_types", None)
    if listed:
        return tuple(dict.fromkeys(torch.device(d).type for d in listed))
    return _BACKEND_DEVICES.get(str(dist.get_backend(pg)), ("cpu",))


def control_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device for small control-plane tensors of a collective over ``group``.

    The CPU when ``group`` serves it; otherwise the device type it serves, with the current
    accelerator's index when that is the accelerator (``cuda:1`` on the rank that set device
    1), else without an index (torch places the tensor on that type's current device).
    """
    types = served_device_types(group)
    if "cpu" in types:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type in types:
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device(types[0])


def default_store() -> Any | None:
    """The default process group's store (``None`` when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
