"""``deepspeed.accelerator.get_accelerator()``: the device a script places its tensors on.

A small view of ``torch.accelerator`` with the members DeepSpeed scripts call
(``device_name``, ``current_device_name``, ``device_count``, ``is_available``,
``communication_backend_name``, ``set_device``); without an accelerator it is the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """The process's accelerator (``torch.accelerator``), or the CPU when there is none."""

    def _type(self) -> str:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return acc.type if acc is not None else "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:1"`` style name; ``"cpu"`` (any index) without an accelerator."""
        kind = self._type()
        return kind if device_index is None or kind == "cpu" else f"{kind}:{device_index}"

    def current_device_name(self) -> str:
        """The name of the device this process uses now."""
        if self._type() == "cpu":
            return "cpu"
        return f"{self._type()}:{torch.accelerator.current_device_index()}"

    def device_count(self) -> int:
        """Accelerators visible to this process (1 for the CPU)."""
        return torch.accelerator.device_count() if self._type() != "cpu" else 1

    def is_available(self) -> bool:
        """Whether an accelerator (not the CPU) is available."""
        return self._type() != "cpu"

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's current accelerator (nothing on the CPU)."""
        if self._type() != "cpu":
            torch.accelerator.set_device_index(device_index)

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for this device (``"gloo"`` on the CPU)."""
        return dist.get_default_backend_for_device(self._type())


def get_accelerator() -> Accelerator:
    """The accelerator of this process (see :class:`Accelerator`)."""
    return Accelerator()
