"""Step-level paired timing: DDP and the zero stages in the same ranks, one step each in turn.

Run from the repository root::

    python -m benchmarks paired_steps --steps 60

Why: the side-by-side benchmark (``python -m benchmarks side_by_side``) runs every implementation
in processes of its own, one after another, and compares rounds. On a shared machine whose speed drifts by
tens of percent within minutes, its per-round ratios to DDP swing from 0.7 to 1.9, and a
difference of a few percent between implementations cannot be resolved even over 24 rounds.
Here every rank builds all the ``--impls`` (the side-by-side's builders, ``benchmarks.kit.impls``) at once
and steps them on the same batch one after another, rotating the order every step so none is
always first; each step is timed alone (per step the slowest rank counts), and the ratio to
DDP is taken per step, between steps a second apart. The drift then cancels in each ratio.

Reported per implementation: the median step, the median of the per-step ratios to DDP with
its interquartile range and a bootstrap 95% interval of that median, and the same median for
the training thread's CPU time (``time.thread_time``: gloo's threads excluded), and rank 0's
training-thread minor page faults per step (pages the allocator took fresh from the kernel:
each costs a kernel entry and a zeroed page, CPU the step pays). What sharing a
process costs: the implementations share the allocator and caches, and each one's memory
stays allocated during the others' steps (memory is the memory benchmark's business, in fresh
processes). The side-by-side stays the reference comparison with FSDP2 and DeepSpeed; this
is the finer instrument between DDP and zero. Writes ``<--name>.json`` and ``.md`` (default
``paired_steps``) into ``--out``. Not a test: nothing is asserted.

``--prefetch-blocks``, ``--live-blocks`` and ``--reuse-blocks`` set stage 3's
``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance``
(in blocks, :func:`benchmarks.kit.impls.block_numel`; defaults: the side-by-side's 0.5, 1.5 and 0) for every
implementation built here; only zero-3 reads them. The first two trade a larger gathered window,
and a higher bound on the gathered parameters, for fewer collectives; with a reuse distance of 0
every parameter is released after use unless the very next module needs it.
``--per-module`` leaves out ``stage3_module_granularity_threshold`` (the side-by-side sets it to
one GPT-2 block's granularity, :func:`benchmarks.kit.impls.block_granularity`, so each block is one leaf);
``--compare-per-module`` steps zero-3 a second time without it, in the same rotation.
``--bucket-blocks`` sets ``reduce_bucket_size`` and ``allgather_bucket_size`` of every zero
stage (default: the side-by-side's 4 blocks); ``--reduce-max-inflight`` zero's
``reduce_max_inflight`` at stages 1 and 2 (default: the side-by-side's 4; 1 is zero's default);
``--compare-reduce-max-inflight N`` steps zero-1 and zero-2 a second time with N, in the same
rotation (an A/B of the setting whose two arms are paired step by step).

``--phases`` times the forward, the backward and the optimizer step apart (each after a
barrier, the slowest rank counting, as a whole step is timed otherwise) and adds a table of
each phase's median wall time, training-thread CPU and page faults beside DDP's. Without a
profiler, this shows which phase a ratio comes from: e.g. whether a stage's step is slower
because of its own CPU or because it waits for a collective (wall above CPU). The barriers
stop one phase's communication from overlapping the next, so a step is then the sum of its
three phases, and the ratios of such a run are not those of a run without ``--phases``.

``--world 1`` runs every implementation in one process, with no communication at all: what
is left of each ratio to DDP is what its own machinery costs (hooks, gathers that only copy,
releases, gradient buckets, optimizer), apart from the wire.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from benchmarks.kit.cli import BenchmarkParser
from benchmarks.kit.impls import IMPLEMENTATIONS, ImplOptions
from benchmarks.kit.measure import StepTiming, spawn_ranks, timed_across_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from benchmarks.kit.workloads import rank_batches, workload_of, workload_parser

PAIRABLE = ("ddp", "fsdp2", "zero-1", "zero-2", "zero-3")
"""Implementations that can share a process (DeepSpeed's engines keep process-wide state)."""


def rotation(names: Sequence[str], step: int) -> list[str]:
    """The order of step ``step``: ``names`` rotated by ``step`` places (each name leads in turn)."""
    k = step % len(names)
    return [*names[k:], *names[:k]]


PHASES = ("forward", "backward", "step")
"""The phases ``--phases`` times apart, in order."""


def _train_step(runner: Any, batch: dict[str, torch.Tensor]) -> None:
    runner.forward_backward(batch)
    runner.optimizer_step()


def _phased_step(runner: Any, batch: dict[str, torch.Tensor]) -> list[StepTiming]:
    """One training step timed phase by phase (:data:`PHASES`), each after a barrier."""
    losses: list[torch.Tensor] = []
    forward = timed_across_ranks(lambda: losses.append(runner.forward(batch)))
    backward = timed_across_ranks(lambda: runner.backward(losses.pop()))
    return [forward, backward, timed_across_ranks(runner.optimizer_step)]


def _whole(phases: Sequence[StepTiming]) -> StepTiming:
    """A step timed phase by phase, as one timing (the sums)."""
    wall = sum(p.wall_s for p in phases)
    return StepTiming(wall, sum(p.thread_cpu_s for p in phases), sum(p.minor_faults for p in phases))


def runner_specs(args: argparse.Namespace) -> list[tuple[str, str, ImplOptions]]:
    """``(label, implementation, options)`` of every runner a rank builds, in ``--impls`` order.

    With ``--compare-reduce-max-inflight N``, zero-1 and zero-2 (where in ``--impls``) are built
    a second time with ``reduce_max_inflight`` N, labelled ``zero-1 (inflight N)``; with
    ``--compare-per-module``, zero-3 a second time without the granularity threshold, labelled
    ``zero-3 (per module)``: both settings step in the same rotation, so their ratios to DDP are
    paired.
    """
    options = options_of(args)
    specs = [(name, name, options) for name in args.impls]
    other = args.compare_reduce_max_inflight
    if other is not None:
        varied = dataclasses.replace(options, reduce_max_inflight=other)
        specs += [
            (f"{name} (inflight {other})", name, varied)
            for name in args.impls
            if name in ("zero-1", "zero-2")
        ]
    if args.compare_per_module:
        specs.append(("zero-3 (per module)", "zero-3", dataclasses.replace(options, leaf_blocks=False)))
    return specs


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: Any) -> None:
    w = workload_of(args)
    specs = runner_specs(args)
    runners = {label: IMPLEMENTATIONS[name](w, args.world, options) for label, name, options in specs}
    names = list(runners)
    batches = rank_batches(w, rank, args.world, 8)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[int]] = {name: [] for name in names}
    phases: dict[str, dict[str, list[list[float]]]] = {name: {p: [] for p in PHASES} for name in names}
    for step in range(args.warmup + args.steps):
        for name in rotation(names, step):
            batch = batches[step % len(batches)]
            if args.phases:
                parts = _phased_step(runners[name], batch)
                timing = _whole(parts)
            else:
                timing = timed_across_ranks(partial(_train_step, runners[name], batch))
            if step >= args.warmup:
                wall[name].append(timing.wall_s)
                cpu[name].append(timing.thread_cpu_s)
                faults[name].append(timing.minor_faults)
                if args.phases:
                    for phase, part in zip(PHASES, parts, strict=True):
                        phases[name][phase].append([part.wall_s, part.thread_cpu_s, part.minor_faults])
    for runner in runners.values():
        runner.close()
    if rank == 0:
        found = {"workload": w.describe(), "wall": wall, "cpu": cpu, "faults": faults}
        results.put(found | ({"phases": phases} if args.phases else {}))


def median_interval(values: Sequence[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``values`` (percentiles 2.5 and 97.5 of ``draws``)."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[min(draws - 1, int(0.975 * draws))]


def summarize(
    wall: dict[str, list[float]], cpu: dict[str, list[float]], faults: dict[str, list[int]] | None = None
) -> dict[str, dict[str, float]]:
    """Per implementation: median step, per-step ratios to DDP (median, quartiles, 95% interval), CPU ratio.

    With ``faults`` (rank 0's training-thread minor page faults per step), their median too.

    Raises:
        ValueError: no ``ddp`` times, or an implementation with another number of steps.
    """
    if "ddp" not in wall:
        raise ValueError("paired_steps compares with DDP: include 'ddp' in --impls")
    out = {}
    for name, times in wall.items():
        if len(times) != len(wall["ddp"]):
            raise ValueError(f"{name} has {len(times)} steps, ddp {len(wall['ddp'])}: not paired")
        ratios = sorted(t / d for t, d in zip(times, wall["ddp"], strict=True))
        cpu_ratios = [c / d for c, d in zip(cpu[name], cpu["ddp"], strict=True) if d > 0]
        low, high = median_interval(ratios)
        out[name] = {
            "median_step_s": statistics.median(times),
            "ratio": statistics.median(ratios),
            "ratio_q1": ratios[len(ratios) // 4],
            "ratio_q3": ratios[(3 * len(ratios)) // 4],
            "ratio_low95": low,
            "ratio_high95": high,
            "cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else float("nan"),
            "steps": len(times),
        }
        if faults is not None and faults.get(name):
            out[name]["faults"] = statistics.median(faults[name])
    return out


def summarize_phases(
    phases: dict[str, dict[str, list[Sequence[float]]]],
) -> dict[str, dict[str, dict[str, float]]]:
    """Per implementation and phase: the median wall time and thread CPU (ms) and page faults.

    ``phases[name][phase]`` lists ``(wall_s, thread_cpu_s, minor_faults)`` per step.

    Raises:
        ValueError: no ``ddp`` phases, or a phase missing or empty.
    """
    if "ddp" not in phases:
        raise ValueError("paired_steps compares with DDP: include 'ddp' in --impls")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, per_phase in phases.items():
        out[name] = {}
        for phase in PHASES:
            steps = per_phase.get(phase)
            if not steps:
                raise ValueError(f"{name} has no timings of its {phase}")
            out[name][phase] = {
                "wall_ms": statistics.median(s[0] for s in steps) * 1e3,
                "cpu_ms": statistics.median(s[1] for s in steps) * 1e3,
                "faults": statistics.median(s[2] for s in steps),
            }
    return out


def phases_table(phases: dict[str, dict[str, dict[str, float]]]) -> str:
    """The markdown table of :func:`summarize_phases`: each phase's medians, the difference from DDP's."""
    ddp = phases["ddp"]

    def cell(name: str, phase: str, key: str) -> str:
        value = phases[name][phase][key]
        return f"{value:.1f}" if name == "ddp" else f"{value:.1f} ({value - ddp[phase][key]:+.1f})"

    rows = [
        [name]
        + [cell(name, p, "wall_ms") for p in PHASES]
        + [cell(name, p, "cpu_ms") for p in PHASES]
        + ["/".join(f"{phases[name][p]['faults']:.0f}" for p in PHASES)]
        for name in phases
    ]
    head = (
        ["implementation"]
        + [f"{p} (ms)" for p in PHASES]
        + [f"{p} CPU (ms)" for p in PHASES]
        + ["page faults " + "/".join(PHASES)]
    )
    return markdown_table(head, rows, "l" + "r" * (len(head) - 1))


def report(summary: dict[str, dict[str, float]], workload: str, env: dict[str, Any], command: str) -> str:
    """The markdown table of :func:`summarize`."""
    rows = [
        [
            name,
            f"{s['median_step_s'] * 1e3:.1f}",
            f"{s['ratio']:.3f}",
            f"{s['ratio_q1']:.3f} - {s['ratio_q3']:.3f}",
            f"{s['ratio_low95']:.3f} - {s['ratio_high95']:.3f}",
            f"{s['cpu_ratio']:.3f}",
            f"{s['faults']:.0f}" if "faults" in s else "-",
        ]
        for name, s in summary.items()
    ]
    steps = next(iter(summary.values()))["steps"]
    return "\n".join(
        [
            f"# Paired steps, world {env['world']}: {steps} steps of each, in rotation",
            "",
            f"{workload}; load average {env['load_average_1m']:.1f} on {env['cpus']} cpus. "
            f"Command: `{command}`.",
            "",
            markdown_table(
                [
                    "implementation",
                    "median step (ms)",
                    "x DDP (median per step)",
                    "quartiles",
                    "95% interval of the median",
                    "thread CPU x DDP",
                    "page faults / step",
                ],
                rows,
                "lrrrrrr",
            ),
            "",
            "Page faults / step: rank 0's training thread, minor faults (a page the allocator got "
            "fresh from the kernel, touched for the first time), median over steps. The "
            "implementations share one heap here, so one's frees can make the next one's "
            "allocations fault.",
        ]
    )


def options_of(args: argparse.Namespace) -> ImplOptions:
    """The builders' options from the command line: stage 3's prefetch bucket, live bound, reuse distance;
    the gradient / parameter buckets of every stage."""
    return ImplOptions(
        leaf_blocks=not args.per_module,
        prefetch_blocks=args.prefetch_blocks,
        live_blocks=args.live_blocks,
        reuse_blocks=args.reuse_blocks,
        bucket_blocks=args.bucket_blocks,
        reduce_max_inflight=args.reduce_max_inflight,
    )


_OPTION_FLAGS = (
    (
        "--prefetch-blocks",
        float,
        "prefetch_blocks",
        "stage 3: stage3_prefetch_bucket_size, in blocks (elements of one transformer block)",
    ),
    ("--live-blocks", float, "live_blocks", "stage 3: stage3_max_live_parameters, in blocks"),
    (
        "--reuse-blocks",
        float,
        "reuse_blocks",
        "stage 3: stage3_max_reuse_distance, in blocks (0: release after use)",
    ),
    (
        "--bucket-blocks",
        float,
        "bucket_blocks",
        "reduce_bucket_size and allgather_bucket_size, in blocks (every stage)",
    ),
    (
        "--reduce-max-inflight",
        int,
        "reduce_max_inflight",
        "zero stages 1 and 2: reduce_max_inflight (buckets reducing at once; 1 is zero's default)",
    ),
)
"""``(flag, type, ImplOptions field, help)`` of the command-line options that set :class:`ImplOptions`."""


def build_parser() -> BenchmarkParser:
    """The command line: the workload's shape, ``--impls``, ``--name``, stage 3's three bounds, the buckets
    and the reductions in flight."""
    parser = workload_parser(
        "paired_steps", __doc__, quick={"warmup": 1, "steps": 4}, world=2, warmup=3, steps=60
    )
    parser.add_argument("--impls", nargs="+", choices=PAIRABLE, default=["ddp", "zero-1", "zero-2", "zero-3"])
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--name", default="paired_steps", help="results file name (without .md / .json)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="time forward, backward and the optimizer step apart (barriers between them) and tabulate them",
    )
    defaults = ImplOptions()
    for flag, kind, field, text in _OPTION_FLAGS:
        parser.add_argument(flag, type=kind, default=getattr(defaults, field), help=text)
    parser.add_argument(
        "--per-module",
        action="store_true",
        help="stage 3: no stage3_module_granularity_threshold (one gather per module, not per GPT-2 block)",
    )
    parser.add_argument(
        "--compare-per-module",
        action="store_true",
        help="also step zero-3 without the granularity threshold (per-module gathers), in the same rotation",
    )
    parser.add_argument(
        "--compare-reduce-max-inflight",
        type=int,
        default=None,
        help="also step zero-1 / zero-2 with this reduce_max_inflight, in the same rotation",
    )
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line ``argv``, checked: DDP in ``--impls``, no negative bound.

    A refused command exits with the parser's usage message (status 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if "ddp" not in args.impls:
        parser.error("--impls must include ddp (every ratio is to DDP)")
    if min(args.prefetch_blocks, args.live_blocks, args.reuse_blocks) < 0:
        parser.error("--prefetch-blocks, --live-blocks and --reuse-blocks must be >= 0 (blocks)")
    compared = args.compare_reduce_max_inflight
    if args.reduce_max_inflight < 1 or (compared is not None and compared < 1):
        parser.error("--reduce-max-inflight and --compare-reduce-max-inflight must be >= 1 (buckets at once)")
    if compared is not None and not {"zero-1", "zero-2"} & set(args.impls):
        parser.error("--compare-reduce-max-inflight varies zero-1 and zero-2: include one of them in --impls")
    if args.compare_per_module and ("zero-3" not in args.impls or args.per_module):
        parser.error("--compare-per-module varies zero-3's leaves: include zero-3, without --per-module")
    return args


def main(argv: Sequence[str]) -> None:
    args = parse_args(argv)
    env = environment("zero-full") | {"world": args.world}
    found = spawn_ranks(_rank_main, args.world, args, args.timeout, process_group=True)
    summary = summarize(found["wall"], found["cpu"], found.get("faults"))
    text = report(summary, found["workload"], env, command_line("paired_steps", argv))
    if "phases" in found:
        text += "\n\n" + "\n".join(
            [
                "## Phase by phase",
                "",
                "Median per phase over the steps (the slowest rank of each); in brackets the difference "
                "from DDP's median. Wall time above the thread's CPU is time the training thread waited "
                "(for a collective, or for a core). A step here is the sum of its phases, each after a "
                "barrier.",
                "",
                phases_table(summarize_phases(found["phases"])),
            ]
        )
    print(text)
    settings = vars(args) | {"out": str(args.out)}
    result = {"environment": env, "args": settings, "summary": summary, **found}
    Report(args.name, result, text).write(args.out)
