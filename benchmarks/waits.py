"""Where a zero step waits for its collectives, without a profiler: lead and wait of each, per position.

Run from the repository root on a quiet machine::

    python -m benchmarks waits --impl zero-3 --steps 30

Each rank builds one zero engine (the side-by-side benchmark's ZeRO section and options,
:class:`benchmarks.kit.impls.ImplOptions`) and, after ``--warmup`` steps, attaches a
:class:`zero_comm.WaitTimings` to its collective watchdog. Every collective waited through the
watchdog is then recorded with three ``time.perf_counter`` readings: issue, start of the wait,
end of the wait. The *lead* (issue to wait) is how long the transfer had to itself; the *wait*
is what the rank lost. A profiler inflates each short range it records; these readings cost
one dictionary entry per collective.

A steady step waits at the same places in the same order, so the ``k``-th wait of every step
is one *position*: per position the phase it falls in (forward, backward or step: the span of
``engine(...)``, ``engine.backward`` and ``engine.step`` it started in), the operation and what
it was for, the median lead, and per rank the median, mean and largest wait over the steps.
Below, per phase, the median per step of the summed waits. Writes ``--out``/``NAME.json``
(``--name``, default ``waits``) and ``.md`` (default ``benchmarks/results``). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from benchmarks.kit.cli import BenchmarkParser
from benchmarks.kit.impls import IMPLEMENTATIONS, ImplOptions
from benchmarks.kit.measure import spawn_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from benchmarks.kit.workloads import rank_batches, workload_of, workload_parser

PHASES = ("forward", "backward", "step")


def _phase(at: float, bounds: tuple[float, float, float, float]) -> str:
    """The phase a wait that started at ``at`` falls in (``bounds``: the phases' start times and the end)."""
    for name, start, stop in zip(PHASES, bounds, bounds[1:]):
        if start <= at < stop:
            return name
    return "step"


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: Any) -> None:
    from zero_comm import WaitTimings

    w = workload_of(args)
    runner = IMPLEMENTATIONS[args.impl](w, args.world, ImplOptions())
    watchdog = runner.engine.watchdog
    if watchdog is None:
        raise RuntimeError(
            "the waits benchmark needs the collective watchdog (robustness.watchdog, on by default)"
        )
    batches = rank_batches(w, rank, args.world, 8)
    for s in range(args.warmup):
        runner.forward_backward(batches[s % len(batches)])
        runner.optimizer_step()
    timings = watchdog.timings = WaitTimings()
    steps: list[dict[str, Any]] = []
    for s in range(args.steps):
        timings.clear()
        t0 = time.perf_counter()
        loss = runner.forward(batches[s % len(batches)])
        t1 = time.perf_counter()
        runner.backward(loss)
        t2 = time.perf_counter()
        runner.optimizer_step()
        t3 = time.perf_counter()
        bounds = (t0, t1, t2, t3)
        waits = [
            {
                "phase": _phase(r.waited, bounds),
                "op": r.op,
                "what": r.what,
                "lead_ms": r.lead_s * 1e3,
                "wait_ms": r.wait_s * 1e3,
            }
            for r in sorted(timings.records, key=lambda r: r.waited)
        ]
        steps.append({"step_ms": (t3 - t0) * 1e3, "waits": waits})
    watchdog.timings = None
    runner.close()
    gathered: list[Any] = [None] * args.world
    dist.all_gather_object(gathered, steps)
    if rank == 0:
        results.put({"workload": w.describe(), "ranks": gathered})


def positions(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per position ``k`` (the ``k``-th wait of every step; as many positions as the fewest waits of a step).

    Phase, op and what (rank 0's first step), median lead (rank 0), per rank the median, mean
    and largest wait.
    """
    counts = {len(step["waits"]) for steps in ranks for step in steps}
    n = min(counts) if counts else 0
    rows = []
    for k in range(n):
        first = ranks[0][0]["waits"][k]
        per_rank = [[step["waits"][k]["wait_ms"] for step in steps] for steps in ranks]
        rows.append(
            {
                "position": k,
                "phase": first["phase"],
                "op": first["op"],
                "what": first["what"],
                "lead_ms": statistics.median(step["waits"][k]["lead_ms"] for step in ranks[0]),
                "wait_median_ms": [statistics.median(v) for v in per_rank],
                "wait_mean_ms": [statistics.fmean(v) for v in per_rank],
                "wait_max_ms": [max(v) for v in per_rank],
            }
        )
    return rows


def phase_totals(ranks: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Per phase, per rank: the median over the steps of the waits summed within a step (ms)."""

    def summed(step: dict[str, Any], phase: str) -> float:
        return sum(w["wait_ms"] for w in step["waits"] if w["phase"] == phase)

    medians = {}
    for phase in PHASES:
        medians[phase] = [statistics.median(summed(step, phase) for step in steps) for steps in ranks]
    return medians


def report(
    found: dict[str, Any], args: argparse.Namespace, env: dict[str, Any], command: str
) -> tuple[str, dict[str, Any]]:
    """The markdown page and the summary of one run."""
    ranks = found["ranks"]
    rows = positions(ranks)
    totals = phase_totals(ranks)
    step_ms = [statistics.median(s["step_ms"] for s in steps) for steps in ranks]
    pair = "{:.2f} / {:.2f}".format
    table = markdown_table(
        ["#", "phase", "collective", "for", "lead (ms)", "wait median", "wait mean", "wait max"],
        [
            [
                r["position"],
                r["phase"],
                r["op"],
                r["what"][:60],
                f"{r['lead_ms']:.1f}",
                pair(*r["wait_median_ms"][:2]) if len(ranks) > 1 else f"{r['wait_median_ms'][0]:.2f}",
                pair(*r["wait_mean_ms"][:2]) if len(ranks) > 1 else f"{r['wait_mean_ms'][0]:.2f}",
                pair(*r["wait_max_ms"][:2]) if len(ranks) > 1 else f"{r['wait_max_ms'][0]:.2f}",
            ]
            for r in rows
        ],
    )
    phases = markdown_table(
        ["phase", *(f"rank {i}: waits (ms / step)" for i in range(len(ranks)))],
        [[phase, *(f"{v:.2f}" for v in totals[phase])] for phase in PHASES],
    )
    text = (
        f"# Collective waits of {args.impl}, world {args.world}\n\n{found['workload']}; "
        f"{args.steps} steps after {args.warmup} warm-up steps; load average {env['load_average_1m']:.1f} "
        f"on {env['cpus']} cpus. Command: `{command}`.\n\n"
        f"Median step: {', '.join(f'rank {i} {v:.1f} ms' for i, v in enumerate(step_ms))}. "
        "Lead: issue to the start of the wait (rank 0, median). Waits: rank 0 / rank 1 (ms).\n\n"
        f"{table}\n\n{phases}\n"
    )
    summary = {"positions": rows, "phase_totals_ms": totals, "median_step_ms": step_ms, "command": command}
    return text, summary


def build_parser() -> BenchmarkParser:
    parser = workload_parser("waits", __doc__, quick={"warmup": 1, "steps": 3}, world=2, warmup=4, steps=30)
    parser.add_argument("--impl", choices=("zero-1", "zero-2", "zero-3"), default="zero-3")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--name", default="waits", help="results file name (without extension)")
    return parser


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    env = environment("zero-full")
    found = spawn_ranks(_rank_main, args.world, args, args.timeout, process_group=True)
    text, summary = report(found, args, env, command_line("waits", argv))
    print(text)
    settings = vars(args) | {"out": str(args.out)}
    result = {"environment": env, "args": settings, **summary, "raw": found}
    Report(args.name, result, text).write(args.out)
