"""Side by side: zero stages 1/2/3 against DDP, FSDP2 and DeepSpeed stages 1/2/3, one run, one machine.

Run from the repository root (``python -m nox -s bench`` does, with every dependency)::

    python -m benchmarks side_by_side --docs docs

For each world size (``--worlds``, default 2 and 4) the launcher first trains the single-process
reference on the whole global batch (in its own process, one thread), then runs every
implementation of :mod:`impls` in turn for ``--rounds`` rounds (the order rotates each round, so
no implementation always runs first or last), each run on ``W`` gloo ranks (one thread each) of
its own, as a user's training does: no run sees the heap, threads or caches that earlier runs
left in the process. ``--shared`` runs every implementation in one set of ranks per world
instead (faster to start; the heap that earlier runs leave behind shifts later ones: a stage-3
run drifted by 14% over three rounds that way). One run of an implementation on a rank:

1. build the model and the implementation;
2. ``--warmup`` training steps; a barrier;
3. ``--steps`` measured training steps: each step timed alone; ``wchar`` of
   ``/proc/self/io`` read before and after the window (nothing is printed inside it);
4. one more step, stopped after backward to count the model-state bytes (distinct storages
   reachable from the implementation's module, optimizer and engine: parameters, gradients,
   optimizer state and whatever buffers they hold), then finished; everything dropped.

Reported per implementation and world: median step time (per step the slowest rank, median over
the measured steps, median over rounds) and its ratio to DDP in the same round (median over
rounds); model-state bytes per rank (largest rank) next to the ZeRO formula; bytes written per
rank per step next to the ring ideal; max |loss - reference loss| over every step of every round
(the ranks' losses averaged per step).

Real memory (RSS) is not measured here (it needs ``MALLOC_MMAP_THRESHOLD_`` set, which would
change the step times measured): the memory benchmark measures it, each implementation in
fresh processes. The report records the command it ran as, with the allocator (``MALLOC_*``) and
thread variables set in its environment: glibc's trimming changes every implementation's page
faults, and so its step time.

Writes ``side_by_side.json`` and ``side_by_side.md`` and three PNG plots into ``--out``; with
``--docs DIR`` also the plots and the table into ``DIR/benchmarks.md``'s ``side-by-side`` block.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.util
import logging
import os
import pathlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.kit.cli import BenchmarkParser
from benchmarks.kit.docs import DocsBlock
from benchmarks.kit.impls import (
    DEFAULT_SIZES,
    IMPLEMENTATIONS,
    formula_state_bytes,
    model_state_bytes,
    ring_ideal_bytes,
)
from benchmarks.kit.measure import read_wchar, thread_minor_faults
from benchmarks.kit.report import Report, command_line, environment, markdown_table, pyplot, save_figure
from benchmarks.kit.workloads import ADAMW, Workload, count_params, rank_batches, workload_of, workload_parser
from zero_launch import RankContext, launch

DISTRIBUTED = [name for name in IMPLEMENTATIONS if name != "single"]
# what runs without --impls: every distributed one but the default-size comparisons (chosen by name)
BY_DEFAULT = [name for name in DISTRIBUTED if name not in DEFAULT_SIZES]
BLOCK = DocsBlock("benchmarks.md", "side-by-side")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to run: workload, implementations, world sizes, rounds and step counts.

    ``fresh``: each run on ranks of its own (the default); ``False``: one set of ranks per world.
    """

    workload: Workload
    impls: tuple[str, ...]
    worlds: tuple[int, ...]
    rounds: int
    warmup: int
    steps: int
    timeout: float
    fresh: bool = True

    @property
    def total_steps(self) -> int:
        """Steps each run trains: warm-up, measured, and the counting step."""
        return self.warmup + self.steps + 1


# ----------------------------------------------------------------------------- one run


def _train_step(runner: Any, batch: dict[str, torch.Tensor]) -> float:
    loss = runner.forward_backward(batch)
    runner.optimizer_step()
    return loss.item()


def run_one(impl: str, plan: Plan, rank: int, world: int, rows: int) -> dict[str, Any]:
    """Train ``impl`` on this rank (``rows``: the slice index; ``world`` 1 = the reference)."""
    w = plan.workload
    gc.collect()
    batches = rank_batches(w, rank, world, plan.total_steps, rows)
    t0 = time.perf_counter()
    runner = IMPLEMENTATIONS[impl](w, world)
    setup_s = time.perf_counter() - t0
    losses = [_train_step(runner, batches[s]) for s in range(plan.warmup)]
    if world > 1:
        dist.barrier()
    times = []
    w0, c0, f0 = read_wchar(), time.process_time(), thread_minor_faults()
    for s in range(plan.warmup, plan.warmup + plan.steps):
        t = time.perf_counter()
        losses.append(_train_step(runner, batches[s]))
        times.append(time.perf_counter() - t)
    cpu = time.process_time() - c0
    faults = thread_minor_faults() - f0
    wrote = read_wchar() - w0
    loss = runner.forward_backward(batches[-1])
    state = model_state_bytes(runner)
    runner.optimizer_step()
    losses.append(loss.item())
    runner.close()
    del runner
    gc.collect()
    return {
        "impl": impl,
        "rank": rank,
        "setup_s": setup_s,
        "step_s": times,
        "cpu_s": cpu / plan.steps,
        "faults_per_step": faults / plan.steps,
        "losses": losses,
        "wchar_bytes": wrote,
        "model_state_bytes": state,
    }


def _round_order(plan: Plan, rnd: int) -> tuple[str, ...]:
    """The implementations of round ``rnd``, rotated so none always runs first or last."""
    shift = rnd % len(plan.impls)
    return plan.impls[shift:] + plan.impls[:shift]


def _join(ctx: RankContext, plan: Plan) -> None:
    """This rank's environment and gloo process group."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(ctx.rank), LOCAL_WORLD_SIZE=str(ctx.world_size))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")  # a warning printed in a measured window would count as bytes sent
    timeout = datetime.timedelta(seconds=plan.timeout)
    dist.init_process_group(
        "gloo", init_method=ctx.init_method, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout
    )


def _rank_main(ctx: RankContext, plan: Plan) -> list[dict[str, Any]]:
    """One rank: every implementation, every round, in one process group."""
    rank, world = ctx.rank, ctx.world_size
    _join(ctx, plan)
    results = []
    for r in range(plan.rounds):
        for impl in _round_order(plan, r):
            results.append({"round": r, **run_one(impl, plan, rank, world, world)})
            if rank == 0:
                print(f"  world {world} round {r + 1}/{plan.rounds}: {impl} done", flush=True)
    dist.destroy_process_group()
    return results


def _rank_one(ctx: RankContext, job: tuple[Plan, int, str]) -> list[dict[str, Any]]:
    """One rank of one implementation's run, in processes of its own (the default layout)."""
    plan, rnd, impl = job
    _join(ctx, plan)
    try:
        return [{"round": rnd, **run_one(impl, plan, ctx.rank, ctx.world_size, ctx.world_size)}]
    finally:
        dist.destroy_process_group()


def run_world(plan: Plan, world: int) -> list[dict[str, Any]]:
    """Launch ``world`` ranks running every distributed implementation; every rank's results.

    With ``plan.fresh`` (the default) each run of an implementation gets ranks of its own (no
    run sees the heap, threads or caches an earlier one left); without, one set of ranks runs
    every round of every implementation. A rank that raises or dies stops the run at once with
    an error naming it (the others killed).
    """
    if not plan.fresh:
        deadline = plan.timeout * plan.rounds * len(plan.impls)
        answers = launch(_rank_main, world, plan, timeout=deadline, process_group=False, name="side-by-side")
        return [row for answer in answers for row in answer.value]
    rows: list[dict[str, Any]] = []
    for r in range(plan.rounds):
        for impl in _round_order(plan, r):
            job = (plan, r, impl)
            answers = launch(_rank_one, world, job, timeout=plan.timeout, process_group=False, name=impl)
            rows += [row for answer in answers for row in answer.value]
            print(f"  world {world} round {r + 1}/{plan.rounds}: {impl} done (fresh processes)", flush=True)
    return rows


def run_reference(plan: Plan, world: int) -> dict[str, Any]:
    """The single-process reference on the whole global batch of ``world`` ranks (this process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"round": 0, **run_one("single", plan, 0, 1, world)}
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- aggregation


def summarize(plan: Plan, world: int, psi: int, ref: dict[str, Any], raw: list[dict[str, Any]]) -> list[dict]:
    """One row per implementation of this world (see the module docstring for each statistic)."""
    by: dict[tuple[str, int], list[dict]] = {}
    for r in raw:
        by.setdefault((r["impl"], r["round"]), []).append(r)

    def round_step_s(impl: str, rnd: int) -> float:
        ranks = by[(impl, rnd)]
        return statistics.median(max(steps) for steps in zip(*(r["step_s"] for r in ranks)))

    def round_cpu_s(impl: str, rnd: int) -> float:
        ranks = by[(impl, rnd)]
        return sum(r["cpu_s"] for r in ranks) / len(ranks)

    def median_and_ratio(of: Callable[[str, int], float], impl: str) -> tuple[float, float | None]:
        """The median over rounds of ``of(impl, round)``, and of its ratio to DDP's in the same round."""
        per_round = [of(impl, rnd) for rnd in range(plan.rounds)]
        ratios = (v / of("ddp", rnd) for rnd, v in enumerate(per_round))
        ratio = statistics.median(ratios) if "ddp" in plan.impls else None
        return statistics.median(per_round), ratio

    rows = []
    for impl in ("single", *[i for i in plan.impls]):
        if impl == "single":
            runs = [[ref]]
            step_s = statistics.median(ref["step_s"])
            ratio = cpu_ratio = None
            cpu_s = ref["cpu_s"]
        else:
            runs = [by[(impl, rnd)] for rnd in range(plan.rounds)]
            step_s, ratio = median_and_ratio(round_step_s, impl)
            cpu_s, cpu_ratio = median_and_ratio(round_cpu_s, impl)
        ranks_n = len(runs[0])
        losses = [[sum(x) / ranks_n for x in zip(*(r["losses"] for r in ranks))] for ranks in runs]
        loss_diff = max(abs(a - b) for run in losses for a, b in zip(run, ref["losses"]))
        state = max(r["model_state_bytes"] for ranks in runs for r in ranks)
        faults = statistics.median(sum(r["faults_per_step"] for r in ranks) / ranks_n for ranks in runs)
        wchar = statistics.median(
            sum(r["wchar_bytes"] for r in ranks) / ranks_n / plan.steps for ranks in runs
        )
        formula = formula_state_bytes(impl, psi, world)
        ideal = ring_ideal_bytes(impl, psi, world)
        rows.append(
            {
                "impl": impl,
                "world": world,
                "step_ms": step_s * 1e3,
                "ratio_to_ddp": ratio,
                "cpu_ms": cpu_s * 1e3,
                "cpu_ratio_to_ddp": cpu_ratio,
                "faults_per_step": faults,
                "round_step_ms": [round_step_s(impl, rnd) * 1e3 for rnd in range(plan.rounds)]
                if impl != "single"
                else [step_s * 1e3],
                "model_state_bytes": state,
                "formula_state_bytes": formula,
                "wchar_bytes_per_step": wchar,
                "ring_ideal_bytes_per_step": ideal,
                "max_abs_loss_diff": loss_diff,
                "setup_s": statistics.median(r["setup_s"] for ranks in runs for r in ranks),
            }
        )
    return rows


# ----------------------------------------------------------------------------- reports


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def table(rows: list[dict]) -> str:
    """The markdown table of one world's rows."""
    headers = [
        "implementation",
        "step ms",
        "x DDP",
        "CPU ms/rank",
        "CPU x DDP",
        "page faults/step",
        "model states MB/rank",
        "formula MB",
        "/ formula",
        "MB sent/rank/step",
        "ring ideal MB",
        "/ ideal",
        "max abs loss diff",
    ]
    cells = []
    for r in rows:
        ideal = r["ring_ideal_bytes_per_step"]
        cells.append(
            [
                r["impl"] + (" (whole global batch)" if r["impl"] == "single" else ""),
                f"{r['step_ms']:.0f}",
                "-" if r["ratio_to_ddp"] is None else f"{r['ratio_to_ddp']:.2f}",
                f"{r['cpu_ms']:.0f}",
                "-" if r["cpu_ratio_to_ddp"] is None else f"{r['cpu_ratio_to_ddp']:.2f}",
                f"{r['faults_per_step']:.0f}",
                _mb(r["model_state_bytes"]),
                _mb(r["formula_state_bytes"]),
                f"{r['model_state_bytes'] / r['formula_state_bytes']:.2f}",
                _mb(r["wchar_bytes_per_step"]),
                _mb(ideal),
                f"{r['wchar_bytes_per_step'] / ideal:.2f}" if ideal else "-",
                f"{r['max_abs_loss_diff']:.1e}",
            ]
        )
    return markdown_table(headers, cells, align="lrrrrrrrrrrrr")


NOTES = (
    "step ms: per step the slowest rank, median over steps, median over rounds. "
    "x DDP: ratio to DDP's step time in the same round, median over rounds. "
    "CPU ms: CPU time of the rank's process (all its threads, gloo's included) per step, mean over ranks, "
    "median over rounds; CPU x DDP likewise, per round: less sensitive than wall time to other jobs on a "
    "shared machine. "
    "Page faults/step: minor page faults of the rank's training thread per measured step (pages the "
    "allocator took fresh from the kernel), mean over ranks, median over rounds. "
    "Model states: distinct tensor storages reachable from the module, optimizer and engine after backward "
    "(params, grads, optimizer state, buffers), largest rank. "
    "Formula: fp32 AdamW ZeRO formula (DDP 16P, stage 1 8P+8P/N, stage 2 4P+12P/N, stage 3 and FSDP2 16P/N). "
    "Real memory (RSS) per rank: see the memory benchmark (python -m benchmarks memory), which runs each "
    "implementation in fresh processes. "
    "MB sent: wchar of /proc/self/io per rank per step; ring ideal: 2P(N-1)/N x 4 bytes (3P(N-1)/N at stage "
    "3 and FSDP2). "
    "Loss diff: against the single process on the same global batch, every step. "
    "MB = 1e6 bytes."
)
"""What the report's columns measure (its last paragraph)."""


def markdown(result: dict[str, Any]) -> str:
    """The whole report: a header with the conditions, one table per world size."""
    meta, plan = result["meta"], result["plan"]
    v = meta["versions"]
    lines = [
        f"Measured {meta['date']} on {meta['cpus']} CPU cores (1-minute load average "
        f"{meta['load_average_1m']:.1f} at the start), torch {v['torch']}, "
        f"deepspeed {v.get('deepspeed') or 'not installed'}, transformers {v.get('transformers')}, "
        f"python {meta['python']}; gloo, one thread per rank, {result['run_seconds']:.0f} s in all.",
        "",
        f"Workload: {result['workload_text']}; P = {result['psi']:,} parameters; fp32 AdamW "
        f"(lr {ADAMW['lr']:g}, betas {tuple(ADAMW['betas'])}, eps {ADAMW['eps']:g}, weight decay "
        f"{ADAMW['weight_decay']:g}) everywhere. {plan['warmup']} warm-up + {plan['steps']} measured steps "
        f"per run, {plan['rounds']} rounds, implementations interleaved"
        + (", each run in fresh processes." if plan.get("fresh") else ", in one set of processes per world."),
        "",
        f"Command: `{result['command']}`" if "command" in result else "(command not recorded)",
        "",
    ]
    for world in plan["worlds"]:
        rows = [r for r in result["rows"] if r["world"] == world]
        lines += [f"World {world}:", "", table(rows), ""]
    lines.append(NOTES)
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out: pathlib.Path, name: str) -> list[pathlib.Path]:
    """Step time, memory per rank and bytes per step by implementation, one bar per world size."""
    plt = pyplot()

    worlds = result["plan"]["worlds"]
    impls = [i for i in result["plan"]["impls"]]
    rows = {(r["impl"], r["world"]): r for r in result["rows"]}
    width = 0.8 / len(worlds)
    # Per plot: the file's suffix, the y axis, the bars' label format, what the values are divided by,
    # the row keys of the bars and of the markers, and the markers' legend label.
    specs = [
        ("step_time", "x DDP", "%.2f", 1, "cpu_ratio_to_ddp", "ratio_to_ddp", "wall clock x DDP"),
        ("memory", "MB", "%.0f", 1e6, "model_state_bytes", "formula_state_bytes", "ZeRO formula"),
        ("bytes", "MB", "%.1f", 1e6, "wchar_bytes_per_step", "ring_ideal_bytes_per_step", "ring ideal"),
    ]
    titles = {
        "step_time": "Step time relative to DDP, same run (bars: CPU time; marker: wall clock)",
        "memory": "Model-state MB per rank (marker: ZeRO formula)",
        "bytes": "MB sent per rank per step (marker: ring ideal)",
    }
    paths = []
    for suffix, ylabel, fmt, unit, bar, marker, marker_label in specs:
        fig, ax = plt.subplots(figsize=(9, 4))
        for k, world in enumerate(worlds):
            xs = [i + (k - (len(worlds) - 1) / 2) * width for i in range(len(impls))]
            ys = [(rows[(i, world)][bar] or 0.0) / unit for i in impls]
            bars = ax.bar(xs, ys, width, label=f"world {world}")
            ax.bar_label(bars, fmt=fmt, fontsize=7)
            ax.scatter(
                xs,
                [(rows[(i, world)][marker] or 0.0) / unit for i in impls],
                color="black",
                marker="_",
                s=200,
                zorder=3,
                label=marker_label if k == 0 else None,
            )
        if ylabel == "x DDP":
            ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(impls)), impls, rotation=20)
        ax.set_ylabel(ylabel)
        ax.set_title(titles[suffix])
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out / f"{name}_{suffix}.png"))
    return paths


# ----------------------------------------------------------------------------- main


def build_parser() -> BenchmarkParser:
    """The command line of :func:`main` (``--shared`` and ``--fresh`` exclude each other)."""
    parser = workload_parser(
        "side_by_side",
        __doc__,
        quick={"worlds": [2], "rounds": 1, "warmup": 1, "steps": 2},
        docs=True,
        rounds=3,
        warmup=2,
        steps=6,
    )
    parser.add_argument("--workload", choices=("gpt2", "mlp", "linear"), default="gpt2")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--impls", nargs="+", default=BY_DEFAULT, choices=DISTRIBUTED)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one run may take")
    parser.add_argument("--name", default="side_by_side", help="result file stem (default side_by_side)")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument(
        "--shared",
        action="store_true",
        help="run every implementation in one set of processes per world instead of each run "
        "(each implementation, each round) in processes of its own, as users do",
    )
    layout.add_argument(
        "--fresh",
        action="store_true",
        help="each run in processes of its own: the default (kept so the commands quoted in "
        "earlier results run unchanged)",
    )
    return parser


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    impls = list(args.impls)
    if importlib.util.find_spec("deepspeed") is None:
        dropped = [i for i in impls if i.startswith("deepspeed")]
        impls = [i for i in impls if not i.startswith("deepspeed")]
        print(f"deepspeed is not installed: skipping {dropped}", file=sys.stderr)
    w = workload_of(args, args.workload)
    plan = Plan(
        w,
        tuple(impls),
        tuple(args.worlds),
        args.rounds,
        args.warmup,
        args.steps,
        args.timeout,
        not args.shared,
    )
    psi = count_params(w)
    env = environment("deepspeed", "transformers", "matplotlib", "zero-full", "zero-optim", "zero-params")
    print(
        f"side-by-side: {w.describe()}, P = {psi:,}; worlds {plan.worlds}, {plan.rounds} rounds x "
        f"{len(plan.impls)} implementations x ({plan.warmup} warm-up + {plan.steps} measured + 1) steps",
        flush=True,
    )
    start = time.monotonic()
    rows, raw = [], {}
    for world in plan.worlds:
        ref = run_reference(plan, world)
        ranks = run_world(plan, world)
        raw[str(world)] = {"reference": ref, "ranks": ranks}
        rows += summarize(plan, world, psi, ref, ranks)
    result = {
        "meta": env,
        "plan": {**dataclasses.asdict(plan), "workload": dataclasses.asdict(w)},
        "workload_text": w.describe(),
        "psi": psi,
        "adamw": {**ADAMW, "betas": list(ADAMW["betas"])},
        "run_seconds": time.monotonic() - start,
        "command": command_line("side_by_side", argv),
        "rows": rows,
        "raw": raw,
    }
    text = markdown(result)
    report = Report(
        args.name, result, f"# Side-by-side benchmark\n\n{text}", plot=plots, block=BLOCK, docs_text=text
    )
    report.write(args.out, args.docs)
    print(text)
