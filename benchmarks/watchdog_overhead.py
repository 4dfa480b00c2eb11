"""A/B: the step time of zero-3 with the collective watchdog on (the default) and off, interleaved.

Run from the repository root on a quiet machine::

    python -m benchmarks watchdog_overhead --world 2 --pairs 60

Each rank builds two zero-3 engines on the same workload (the side-by-side benchmark's ZeRO
section, :func:`benchmarks.kit.impls.zero_section`): ``on`` with the default ``robustness`` section (watchdog
on, ``check_paths`` off: the trace-departure check is part of it) and ``off`` with
``robustness.watchdog = false``. Both live for the whole run, in the same processes and process
group; after ``--warmup`` steps of each, ``--pairs`` pairs of steps run, the order inside a pair
alternating (on-off, off-on, ...) so neither always runs first. Each step is timed alone; per
step the slowest rank counts (the ranks start it together after a barrier; an all-reduce of
the time after the step, outside the window: :func:`benchmarks.kit.measure.timed_across_ranks`).

With ``--check calls`` one engine runs both sides, its engine-call check switched on and off
before each step: two engines in one process differ in speed by themselves, even when
configured alike. ``on`` is the default (``robustness.check_calls = true``: one 64-byte
all-gather before the first collective of each engine call that communicates), ``off`` switches
it off; results go to ``divergence_check_overhead.json`` / ``.md`` (goal <= 1%). The checks per
step are counted, not assumed: the collectives a step issues with the check on, minus off (under
zero-3 the forward and the backward gather; the step issues collectives of its own when it
re-gathers persistent parameters or clips).

Reported: the median step of each, the overhead ``median(on) / median(off) - 1`` (goal <= 2%),
and the median of the per-pair ratios with its 95% bootstrap interval. Writes
``watchdog_overhead.json`` and ``.md`` into ``--out``. The 1-minute load average is recorded: a
figure measured on a loaded machine says so. The ``off`` engine shares its process with the
``on`` engine's heartbeat thread (one store write per ``heartbeat_interval``, 2 s by default), so
the overhead reported is what the watchdog adds per collective and per wait. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.impls import zero_section
from benchmarks.kit.measure import spawn_ranks, timed_across_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from benchmarks.kit.workloads import Workload, adamw, build_model, global_batch, loss_of, rank_slice


def _engine(w: Workload, on: bool, check: str) -> Any:
    import zero_full

    robustness = {"watchdog": on} if check == "watchdog" else {"check_calls": on}
    config = {"zero_optimization": zero_section(3, w), "robustness": robustness}
    return zero_full.initialize(build_model(w), config=config, optimizer=adamw)


def _step(engine: Any, w: Workload, batch: dict[str, torch.Tensor]) -> None:
    engine.backward(loss_of(engine, w, batch))
    engine.step()


def _calls_issued(engine: Any) -> int:
    """Collectives the engine's watchdog saw so far (0 without a watchdog: the ``off`` engine)."""
    return 0 if engine.watchdog is None else engine.watchdog.calls_issued


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: Any) -> None:
    w = Workload(kind=args.workload, layers=args.layers, hidden=args.hidden, micro_batch=args.micro_batch)
    if args.check == "calls":  # one engine, the check switched per step: nothing else differs
        engine = _engine(w, True, args.check)
        engines = {"on": engine, "off": engine}
    else:
        engines = {"on": _engine(w, True, args.check), "off": _engine(w, False, args.check)}
    steps = args.warmup + args.pairs
    batches = [rank_slice(global_batch(w, s % 8, args.world), rank, args.world) for s in range(8)]
    times: dict[str, list[float]] = {"on": [], "off": []}
    issued: dict[str, list[int]] = {"on": [], "off": []}  # collectives per step (check included)
    for s in range(steps):
        order = ("on", "off") if s % 2 == 0 else ("off", "on")
        for name in order:
            engine = engines[name]
            if args.check == "calls":
                engine.watchdog.check_calls = name == "on"
            before = _calls_issued(engine)
            took = timed_across_ranks(partial(_step, engine, w, batches[s % len(batches)])).wall_s
            if s >= args.warmup:
                times[name].append(took)
                issued[name].append(_calls_issued(engine) - before)
    if args.check == "calls":  # the check alone, as often as the pairs: its direct cost
        engines["on"].watchdog.check_calls = True
        check = partial(engines["on"].watchdog.check_call, "benchmark", 0, 0)
        times["check"] = [timed_across_ranks(check).wall_s for _ in range(args.pairs)]
    for engine in {id(e): e for e in engines.values()}.values():
        engine.close()
    if rank == 0:
        # Counted by one engine's watchdog with the check on and off; the watchdog A/B has no count.
        checks = (
            statistics.median(issued["on"]) - statistics.median(issued["off"]) if args.check == "calls" else 0
        )
        results.put({"workload": w.describe(), "times": times, "checks_per_step": checks})


_NAMES = {
    "watchdog": ("watchdog_overhead", "Watchdog"),
    "calls": ("divergence_check_overhead", "Divergence check (robustness.check_calls)"),
}


def median_interval(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (percentiles of resampled medians).

    Step times on a shared machine spread by several percent from step to step, so a median pair
    ratio is published with the range it could have taken: a goal is met when the interval is.
    """
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summarize(times: dict[str, list[float]], checks_per_step: float = 0.0) -> dict[str, Any]:
    """Medians, the overhead of ``on`` over ``off``, the median per-pair ratio and its 95% interval.

    With the check timed alone (``times["check"]``): its median and the share of the median
    ``off`` step that ``checks_per_step`` of them take.
    """
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    pairs = [a / b for a, b in zip(times["on"], times["off"]) if b > 0]
    direct = {}
    if times.get("check"):
        one = statistics.median(times["check"])
        direct = {
            "median_check_s": one,
            "checks_per_step": checks_per_step,
            "direct_share": checks_per_step * one / off,
        }
    return direct | {
        "median_on_s": on,
        "median_off_s": off,
        "overhead": on / off - 1.0,
        "median_pair_ratio": statistics.median(pairs) if pairs else float("nan"),
        "pair_ratio_interval": median_interval(pairs) if pairs else (float("nan"), float("nan")),
        "pairs": len(pairs),
    }


DEFAULTS = dict(layers=4, hidden=256, micro_batch=4, world=2, warmup=3, pairs=60)
QUICK = dict(layers=2, hidden=64, warmup=1, pairs=4)


def build_parser() -> BenchmarkParser:
    parser = benchmark_parser("watchdog_overhead", __doc__, quick=QUICK, **DEFAULTS)
    parser.add_argument("--workload", choices=("gpt2", "mlp", "linear"), default="gpt2")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument(
        "--check",
        choices=("watchdog", "calls"),
        default="watchdog",
        help="what on / off toggles: the watchdog, or the engine-call check (robustness.check_calls)",
    )
    return parser


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    env = environment("zero-full")  # before the ranks run: the load they add is not "other work"
    found = spawn_ranks(_rank_main, args.world, args, args.timeout, process_group=True)
    summary = summarize(found["times"], found.get("checks_per_step", 0.0))
    loaded = env["load_average_1m"] > 0.5 * (env["cpus"] or 1)
    label = " (LOADED machine: not a valid timing)" if loaded else ""
    name, what = _NAMES[args.check]
    text = (
        f"# {what} overhead, zero-3, world {args.world}{label}\n\n{found['workload']}; "
        f"load average {env['load_average_1m']:.1f} on {env['cpus']} cpus\n\n"
        + markdown_table(
            [args.check, "median step (ms)", "overhead", "median per-pair ratio", "95% interval", "pairs"],
            [
                ["off", f"{summary['median_off_s'] * 1e3:.1f}", "", "", "", summary["pairs"]],
                [
                    "on (default)",
                    f"{summary['median_on_s'] * 1e3:.1f}",
                    f"{summary['overhead'] * 100:+.1f}%",
                    f"{summary['median_pair_ratio']:.3f}",
                    "{:.3f}-{:.3f}".format(*summary["pair_ratio_interval"]),
                    summary["pairs"],
                ],
            ],
        )
    )
    if "direct_share" in summary:
        text += (
            f"\n\nThe check alone: median {summary['median_check_s'] * 1e3:.2f} ms; "
            f"{summary['checks_per_step']:g} per step (collectives per step, on minus off) = "
            f"{summary['direct_share'] * 100:.2f}% of the median step (off).\n"
        )
    print(text)
    settings = vars(args) | {"out": str(args.out)}
    result = {"environment": env, "loaded": loaded, "args": settings, **summary}
    result["times"] = found["times"]
    Report(name, result, text, command_line("watchdog_overhead", argv)).write(args.out)
