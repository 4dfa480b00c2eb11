"""Who sends what to whom: rank-pair bytes of recorded collectives, and the inter-node share."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["RING_OPS", "SPREAD_OPS", "TrafficRecord", "node_egress_bytes", "pair_bytes"]

RING_OPS = frozenset({"all_gather", "quantized_all_gather", "all_reduce"})
"""Collectives gloo runs as a ring: all wire bytes go to the next group member."""

SPREAD_OPS = frozenset({"all_to_all", "reduce_scatter", "quantized_all_to_all"})
"""Collectives that send an equal block to every other group member."""

TrafficRecord = tuple[str, tuple[int, ...], int, int]
"""``(op, group_ranks, payload_bytes, wire_bytes)`` of one collective as seen by one rank."""


def _as_tuple(record: Any) -> TrafficRecord:
    if isinstance(record, tuple):
        op, ranks, payload, wire = record
        return str(op), tuple(ranks), int(payload), int(wire)
    return record.op, tuple(record.group_ranks), int(record.payload_bytes), int(record.wire_bytes)


def pair_bytes(sender: int, records: Iterable[Any]) -> dict[int, float]:
    """Bytes ``sender`` sends to each other global rank for ``records`` (that rank's own records).

    Raises:
        ValueError: a record of an unknown collective, or one whose group does not hold ``sender``.
    """
    sent: dict[int, float] = {}
    for record in records:
        op, ranks, payload, wire = _as_tuple(record)
        if sender not in ranks:
            raise ValueError(f"a {op} record of rank {sender} has a group {list(ranks)} without that rank")
        others = [r for r in ranks if r != sender]
        if not others:
            continue
        if op in RING_OPS:
            dest = ranks[(ranks.index(sender) + 1) % len(ranks)]
            sent[dest] = sent.get(dest, 0.0) + wire
        elif op in SPREAD_OPS:
            for dest in others:
                sent[dest] = sent.get(dest, 0.0) + wire / len(others)
        elif op == "broadcast":
            for dest in others if payload else ():
                sent[dest] = sent.get(dest, 0.0) + payload
        else:
            raise ValueError(
                f"no traffic model for collective {op!r}; add it to RING_OPS or SPREAD_OPS in "
                "zero_testing.traffic after measuring how gloo moves it"
            )
    return sent


def node_egress_bytes(records_by_rank: Sequence[Iterable[Any]], ranks_per_node: int) -> list[float]:
    """Bytes each node sends to other nodes, from every rank's records (index = global rank)."""
    world = len(records_by_rank)
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide the {world} ranks")
    egress = [0.0] * (world // ranks_per_node)
    for sender, records in enumerate(records_by_rank):
        node = sender // ranks_per_node
        for dest, nbytes in pair_bytes(sender, records).items():
            if dest // ranks_per_node != node:
                egress[node] += nbytes
    return egress
