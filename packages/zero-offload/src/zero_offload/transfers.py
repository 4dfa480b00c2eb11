"""``Transfers``: the count and the bytes of one kind of offload traffic."""

from __future__ import annotations

import dataclasses

__all__ = ["Transfers"]


@dataclasses.dataclass
class Transfers:
    """How many transfers of one kind were made (host <-> device copies, swap reads or writes)
    and how many bytes they moved."""

    count: int = 0
    nbytes: int = 0

    def add(self, nbytes: int) -> None:
        """Count one transfer of ``nbytes``."""
        self.count += 1
        self.nbytes += nbytes
