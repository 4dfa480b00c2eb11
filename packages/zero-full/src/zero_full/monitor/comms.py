"""``comms_logger``: the engine's collectives summed by operation and message size (rank 0).

zero's :class:`~zero_comm.CommLedger` records every collective of the engine (operation, bytes
this rank contributes, ring-ideal bytes it sends); :class:`CommsTable` adds up each optimizer
step's records the way DeepSpeed's comms logger groups them (by operation, then message size)
and prints the table when the engine closes. ``verbose`` also logs each record.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from zero_comm import CommRecord
from zero_comm.units import format_bytes
from zero_full.config.monitoring import CommsLoggerConfig

__all__ = ["CommsTable"]

logger = logging.getLogger("zero.monitor")


@dataclasses.dataclass
class _Row:
    count: int = 0
    sent_bytes: int = 0


class CommsTable:
    """Counts of the engine's collectives by ``(operation, message bytes)``."""

    def __init__(self, config: CommsLoggerConfig) -> None:
        self.config = config
        self.rows: dict[tuple[str, int], _Row] = {}

    def add(self, records: Iterable[CommRecord]) -> None:
        """Count one optimizer step's records (the operations ``prof_all`` / ``prof_ops`` select)."""
        for r in records:
            if not self.config.prof_all and r.op not in self.config.prof_ops:
                continue
            row = self.rows.setdefault((r.op, r.payload_bytes), _Row())
            row.count += 1
            row.sent_bytes += r.wire_bytes
            if self.config.verbose:
                logger.info(
                    "zero comm op: %s | msg size: %s | sent: %s",
                    r.op,
                    format_bytes(r.payload_bytes, binary=True),
                    format_bytes(r.wire_bytes, binary=True),
                )

    def table(self) -> str:
        """Operation, message size, count and bytes sent, one line per size (DeepSpeed's summary)."""
        head = f"{'Comm. Op':<16} {'Message Size':>14} {'Count':>8} {'Total Sent':>14}"
        lines = [head]
        for op in sorted({op for op, _ in self.rows}):
            lines.append(op)
            for (name, size), row in sorted(self.rows.items()):
                if name == op:
                    lines.append(
                        f"{'':<16} {format_bytes(size, binary=True):>14} {row.count:>8} "
                        f"{format_bytes(row.sent_bytes, binary=True):>14}"
                    )
        return "\n".join(lines)
