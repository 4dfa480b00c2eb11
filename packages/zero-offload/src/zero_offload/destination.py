"""Where offloaded tensors live: the target and the fields every offload config starts with."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import ClassVar

__all__ = ["OffloadDestination", "OffloadTarget"]


class OffloadTarget(enum.Enum):
    """Where offloaded tensors live: host memory or swap files on an NVMe drive."""

    CPU = "cpu"
    NVME = "nvme"


@dataclasses.dataclass(frozen=True)
class OffloadDestination:
    """Host memory (``cpu``) or swap files in ``nvme_path``, a directory on the NVMe drive
    (``nvme``): the first fields of the optimizer's and the parameters' offload configs."""

    _WHAT: ClassVar[str] = "offload"

    device: OffloadTarget = OffloadTarget.CPU
    nvme_path: Path | None = None

    def __post_init__(self) -> None:
        if self.device is OffloadTarget.NVME and self.nvme_path is None:
            raise ValueError(f"{self._WHAT} to nvme needs nvme_path (a directory on the NVMe drive)")
