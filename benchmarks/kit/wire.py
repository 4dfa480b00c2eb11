"""What a collective costs on this machine: a sweep of sizes and a line fitted through it.

:func:`comm_sweep` times ``all_gather_single`` and ``all_to_all_single`` over a few sizes on
every rank (the process group is up); :func:`fit_cost` fits ``seconds = latency + bytes x cost``
to them, the cost per byte on the wire the profile and growth benchmarks price bytes with.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from zero_comm.torch_compat import all_gather_single

__all__ = ["SWEEP_BYTES", "comm_sweep", "fit_cost", "slowest"]

SWEEP_BYTES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)  # bytes per rank's input


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (an all-reduce: every rank gets it)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def comm_sweep(world: int, repeats: int) -> list[dict[str, Any]]:
    """Median seconds of all_gather_single / all_to_all_single per size, with the ring-ideal bytes sent."""
    rows = []
    for nbytes in SWEEP_BYTES:
        n = nbytes // 4
        shard = torch.randn(n)
        gathered = torch.empty(world * n)
        send, recv = torch.randn(n * world), torch.empty(n * world)
        calls = (
            ("all_gather", all_gather_single, (gathered, shard)),
            ("all_to_all", dist.all_to_all_single, (recv, send)),
        )
        for op, fn, fn_args in calls:
            wire = (world - 1) * nbytes
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                t = time.perf_counter()
                fn(*fn_args)
                times.append(slowest(time.perf_counter() - t))
            rows.append({"op": op, "wire_bytes": wire, "seconds": statistics.median(times[1:])})
    return rows


def fit_cost(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Least squares ``seconds = latency + wire_bytes x cost``; returns ``(latency_s, cost_s_per_byte)``."""
    xs = [r["wire_bytes"] for r in rows]
    ys = [r["seconds"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    cost = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - cost * mx, cost
