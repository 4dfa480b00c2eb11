"""Byte accounting of zero-comm collectives: :class:`CommLedger`.

While a ledger is active (``with CommLedger(topology) as ledger:``), every zero-comm
collective appends one :class:`CommRecord` per collective it issues (a hierarchical
all-gather issues two, one per hop). A call whose group has one rank, or whose payload
is empty, moves nothing but is still recorded (with ``wire_bytes == 0``), so counts
reflect calls made.

The active ledger is found through a ``contextvars.ContextVar``: recording costs one
``ContextVar.get()`` when no ledger is active. Ledgers nest: a record goes to the
innermost active ledger and to every enclosing one. Context variables are per thread:
collectives issued from another thread are recorded only if that thread entered a ledger.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Iterable

from torch.distributed import ProcessGroup

from zero_comm.topology import LinkKind, Topology, group_ranks
from zero_comm.units import format_bytes
from zero_comm.watchdog import CommWatchdog
from zero_comm.watched import activate, deactivate

__all__ = ["CommLedger", "CommRecord", "CommTotals", "record", "ring_wire_bytes"]

# The one module-level object: it only points at the active ledger of the current context.
_ACTIVE: contextvars.ContextVar[CommLedger | None] = contextvars.ContextVar("zero_comm_ledger", default=None)


def ring_wire_bytes(op: str, nbytes: int, world: int) -> int:
    """Ring-ideal bytes one rank sends for a collective over ``world`` ranks.

    Args:
        op: ``"all_gather"`` (``nbytes`` = this rank's shard), ``"reduce_scatter"`` or
            ``"all_to_all"`` (``nbytes`` = this rank's whole input), ``"all_reduce"`` or
            ``"broadcast"`` (``nbytes`` = the tensor).
        nbytes: Bytes as described above.
        world: Group size.

    Returns:
        ``(W-1) * nbytes`` for all-gather; ``(W-1)/W * nbytes`` for reduce-scatter,
        all-to-all and broadcast (a pipelined broadcast forwards the tensor ``W-1`` times in
        total, averaged over the ranks); ``2(W-1)/W * nbytes`` for all-reduce. Rounded down.

    Raises:
        ValueError: unknown ``op``.
    """
    if op == "all_gather":
        return (world - 1) * nbytes
    if op in ("reduce_scatter", "all_to_all", "broadcast"):
        return (world - 1) * nbytes // world
    if op == "all_reduce":
        return 2 * (world - 1) * nbytes // world
    raise ValueError(
        f"ring_wire_bytes: unknown collective {op!r}; use all_gather, reduce_scatter, all_to_all, "
        "all_reduce or broadcast"
    )


@dataclasses.dataclass(frozen=True)
class CommRecord:
    """One collective as seen by this rank.

    Attributes:
        op: Collective kind, e.g. ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``.
        group_ranks: Global ranks of the group, in group-rank order.
        link: Whether the group crosses nodes.
        payload_bytes: Logical bytes this rank contributes (unpadded).
        wire_bytes: Ring-ideal bytes this rank sends (see :func:`ring_wire_bytes`).
        step: The ledger step during which it was issued.
    """

    op: str
    group_ranks: tuple[int, ...]
    link: LinkKind
    payload_bytes: int
    wire_bytes: int
    step: int


@dataclasses.dataclass(frozen=True)
class CommTotals:
    """Sums over a selection of records."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0

    def __add__(self, other: CommTotals) -> CommTotals:
        return CommTotals(
            self.calls + other.calls,
            self.payload_bytes + other.payload_bytes,
            self.wire_bytes + other.wire_bytes,
        )


def record(op: str, group: ProcessGroup | None, *, payload_bytes: int, wire_bytes: int) -> None:
    """Report one collective to the active ledger(s); a no-op when none is active.

    Collectives outside this module (e.g. quantized ones) call this once per collective
    they issue, with ``wire_bytes`` usually from :func:`ring_wire_bytes`.

    Args:
        op: Collective kind.
        group: The process group it runs on (``None`` is the world group).
        payload_bytes: Logical bytes this rank contributes.
        wire_bytes: Ring-ideal bytes this rank sends.
    """
    ledger = _ACTIVE.get()
    while ledger is not None:
        ledger.add(op, group, payload_bytes=payload_bytes, wire_bytes=wire_bytes)
        ledger = ledger.parent


class CommLedger:
    """Records every zero-comm collective issued while it is active.

    Example:
        ```python
        with CommLedger(topology) as ledger:
            for batch in loader:
                train_step(batch)
                ledger.step()
        print(ledger.summary())
        ```

    Args:
        topology: Used to classify groups as intra- or inter-node.
        watchdog: A :class:`~zero_comm.CommWatchdog` that watches every collective issued
            while this ledger is active (see :mod:`zero_comm.watchdog`), or ``None``.
    """

    __slots__ = ("_group_cache", "_step", "_token", "_watching", "parent", "records", "topology", "watchdog")

    def __init__(self, topology: Topology, watchdog: CommWatchdog | None = None) -> None:
        self.topology = topology
        self.watchdog = watchdog
        self.records: list[CommRecord] = []
        self.parent: CommLedger | None = None
        self._step = 0
        self._token: contextvars.Token[CommLedger | None] | None = None
        self._watching: contextvars.Token[CommWatchdog | None] | None = None
        self._group_cache: dict[ProcessGroup | None, tuple[tuple[int, ...], LinkKind]] = {}

    def __enter__(self) -> CommLedger:
        if self._token is not None:
            raise RuntimeError("this CommLedger is already active; create a new one to nest")
        self.parent = _ACTIVE.get()
        self._token = _ACTIVE.set(self)
        if self.watchdog is not None:  # an inner ledger without one leaves the outer one's active
            self._watching = activate(self.watchdog)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watching is not None:
            deactivate(self._watching)
        if self._token is not None:
            _ACTIVE.reset(self._token)
        self._token = None
        self._watching = None
        self.parent = None

    @property
    def current_step(self) -> int:
        """Index of the step being recorded (starts at 0)."""
        return self._step

    def step(self) -> int:
        """Close the current step; later records belong to the next one. Returns its index."""
        self._step += 1
        return self._step

    def add(self, op: str, group: ProcessGroup | None, *, payload_bytes: int, wire_bytes: int) -> CommRecord:
        """Append a record for ``group`` at the current step (what :func:`record` calls)."""
        known = self._group_cache.get(group)
        if known is None:
            known = (group_ranks(group), self.topology.link_kind(group))
            self._group_cache[group] = known
        rec = CommRecord(op, known[0], known[1], int(payload_bytes), int(wire_bytes), self._step)
        self.records.append(rec)
        return rec

    def select(
        self, op: str | None = None, link: LinkKind | str | None = None, step: int | None = None
    ) -> list[CommRecord]:
        """Records matching every given filter (``None`` matches all)."""
        kind = LinkKind(link) if isinstance(link, str) else link
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (kind is None or r.link is kind)
            and (step is None or r.step == step)
        ]

    def totals(
        self, op: str | None = None, link: LinkKind | str | None = None, step: int | None = None
    ) -> CommTotals:
        """Calls, payload bytes and wire bytes over the matching records."""
        return _sum(self.select(op, link, step))

    def count(
        self, op: str | None = None, link: LinkKind | str | None = None, step: int | None = None
    ) -> int:
        """Number of matching records."""
        return len(self.select(op, link, step))

    def summary(self) -> str:
        """A per-step table of calls and bytes by collective and link kind, with a total line."""
        rows: dict[tuple[int, str, str], CommTotals] = {}
        for r in self.records:
            key = (r.step, r.op, r.link.value)
            rows[key] = rows.get(key, CommTotals()) + CommTotals(1, r.payload_bytes, r.wire_bytes)
        head = f"{'step':>4}  {'op':<16} {'link':<10} {'calls':>6} {'payload':>12} {'wire':>12}"
        lines = [
            f"CommLedger: rank {self.topology.rank} of {self.topology.world_size} "
            f"({self.topology.num_nodes} node(s) x {self.topology.ranks_per_node})",
            head,
            "-" * len(head),
        ]
        for (step, op, link), t in sorted(rows.items()):
            lines.append(
                f"{step:>4}  {op:<16} {link:<10} {t.calls:>6} "
                f"{format_bytes(t.payload_bytes, binary=True):>12} "
                f"{format_bytes(t.wire_bytes, binary=True):>12}"
            )
        total = _sum(self.records)
        lines.append("-" * len(head))
        lines.append(
            f"{'all':>4}  {'':<16} {'':<10} {total.calls:>6} "
            f"{format_bytes(total.payload_bytes, binary=True):>12} "
            f"{format_bytes(total.wire_bytes, binary=True):>12}"
        )
        return "\n".join(lines)


def _sum(records: Iterable[CommRecord]) -> CommTotals:
    calls = payload = wire = 0
    for r in records:
        calls += 1
        payload += r.payload_bytes
        wire += r.wire_bytes
    return CommTotals(calls, payload, wire)
