"""Real memory per rank: DDP, FSDP2, DeepSpeed and zero stages 1/2/3, each in fresh processes.

Run from the repository root (``python -m nox -s bench`` does, with every dependency)::

    python -m benchmarks memory [--quick] [--name memory] [--docs docs]

For each workload (a stack of bias-free ``Linear`` layers where parameters dominate, and a
``transformers`` GPT-2 of comparable size; ``--quick``: small ones), each world size
(``--worlds``, default 2 and 4) and each implementation (``ddp``, ``fsdp2``, ``deepspeed-1/2/3``,
``zero-1/2/3``, ``zero-3+ckpt``, zero stage 3 with activation checkpointing of every block, and
``zero-3+leaf``, zero stage 3 gathering each GPT-2 block as one leaf, as the speed benchmarks do; GPT-2 only;
``zero-1/2/3+defaults``, an empty ``zero_optimization`` section but for the stage, zero's defaults sized
from the model; ``zero-3+dsdefaults``, the same with DeepSpeed's default sizes given explicitly),
the launcher spawns ``W`` FRESH gloo ranks (``benchmarks.kit.measure.spawn_ranks``) with
``MALLOC_MMAP_THRESHOLD_=1048576`` (glibc returns every freed block of 1 MiB or more to the
kernel, so the RSS follows the live tensors) and ``OMP_NUM_THREADS=1``. On each rank:

1. torch is imported and the gloo process group formed: the RSS now is the *runtime*'s own;
2. the implementation's libraries are imported (``torch._dynamo``, which every implementation
   ends up importing, ``transformers``, ``deepspeed``, ``zero_full``, FSDP): the RSS now is the
   *baseline*, everything before the model (*imports* = baseline - runtime);
3. the model and the implementation are built and ``--warmup`` steps trained (optimizer state
   created, stage-3 traces recorded);
4. ``--steps`` measured steps, each: RSS at *rest*; peak reset (``/proc/self/clear_refs``);
   forward; RSS (*forward holds*: what forward added and still holds when backward starts);
   backward and optimizer step; peak RSS (``VmHWM``);
5. one more step, stopped after backward to count model-state bytes from the implementation's
   storages (``benchmarks.kit.impls.model_state_bytes``: a second figure, not the evidence).

Reported per implementation (largest rank; each figure the largest over the measured steps):
RSS at rest above the baseline next to the ZeRO formula (fp32 AdamW: DDP 16P; stage 1
8P+8P/N; stage 2 4P+12P/N; stage 3 and FSDP2 16P/N), what forward holds, and the step's peak
above the baseline (rest + what the step adds) next to DDP's. Stage 3 (zero and DeepSpeed)
runs with a release policy that really releases: persistence threshold 0, prefetch one
block, two blocks live at most, no reuse (DeepSpeed's defaults keep small models gathered).

A rank that dies is named with its exit code (``spawn_ranks``), the run is recorded as
failed and the next one starts; a run that exceeds ``--timeout`` is killed. Writes
``<name>.json``, ``<name>.md`` and ``<name>.png`` into ``--out``; with ``--docs DIR`` also the
plot to ``DIR/assets/benchmarks/`` and the tables into ``DIR/memory.md`` between its
``memory-benchmark`` markers. Each row records the command that measured it
(``benchmarks.kit.report.command_line``: the arguments and any ``MALLOC_*`` or thread variable
set before the benchmark sets its own), and the report names it. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.docs import DocsBlock
from benchmarks.kit.measure import spawn_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table, pyplot, save_figure
from benchmarks.kit.step_memory import (
    IMPLS,
    MEASURED_ENV,
    RELEASE,
    Run,
    count_params,
    failed_row,
    impls_for,
    rank_main,
    summarize,
)
from benchmarks.kit.workloads import ADAMW, Workload

BLOCK = DocsBlock("memory.md", "memory-benchmark")

WORKLOADS = {
    # >= 100M parameters, parameters dominate: 6 x 4096^2 = 100.7M, two rows per rank.
    "linear": Workload("linear", layers=6, hidden=4096, micro_batch=2),
    # GPT-2 of comparable size: 8 blocks x 12 x 1024^2 + embeddings = 109M, one 64-token sequence.
    "gpt2": Workload("gpt2", layers=8, hidden=1024, heads=16, vocab=8192, seq=64, micro_batch=1),
}
# ``--medium``: a few minutes per implementation pair on two cores; each layer above 2**20
# elements, so zero's defaults sized from the model are not its floor.
MEDIUM_WORKLOADS = {
    "linear": Workload("linear", layers=5, hidden=2048, micro_batch=2),
    "gpt2": Workload("gpt2", layers=4, hidden=512, heads=8, vocab=8192, seq=64, micro_batch=1),
}
QUICK_WORKLOADS = {
    "linear": Workload("linear", layers=4, hidden=1024, micro_batch=2),
    "gpt2": Workload("gpt2", layers=2, hidden=256, heads=4, vocab=4096, seq=32, micro_batch=1),
}


# ----------------------------------------------------------------------------- reports


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of one workload at one world size."""
    ddp = next((r for r in rows if r["impl"] == "ddp" and r["error"] is None), None)
    headers = [
        "implementation",
        "at rest MB",
        "formula MB",
        "rest / formula",
        "forward holds MB",
        "step peak MB (rest + added)",
        "backward / optimizer step add MB",
        "peak / DDP's",
        "model states counted MB",
        "imports MB",
    ]
    cells = []
    for r in rows:
        if r["error"] is not None:
            cells.append([r["impl"], f"failed: {r['error'].splitlines()[0]}", *["-"] * 8])
            continue
        cells.append(
            [
                r["impl"],
                _mb(r["rest_bytes"]),
                _mb(r["formula_bytes"]),
                f"{r['rest_bytes'] / r['formula_bytes']:.2f}",
                _mb(r["forward_bytes"]),
                f"{_mb(r['step_peak_bytes'])} ({_mb(r['rest_bytes'])} + {_mb(r['peak_added_bytes'])})",
                f"{_mb(r.get('backward_added_bytes'))} / {_mb(r.get('optimizer_added_bytes'))}",
                f"{r['step_peak_bytes'] / ddp['step_peak_bytes']:.2f}" if ddp else "-",
                _mb(r["model_state_bytes"]),
                _mb(r["imports_bytes"]),
            ]
        )
    return markdown_table(headers, cells, align="lrrrrrrrrr")


def markdown(result: dict[str, Any]) -> str:
    """The report: the conditions, one table per workload and world size, how to read it."""
    meta = result["meta"]
    v = meta["versions"]
    runtimes = [r["runtime_bytes"] for r in result["rows"] if r["error"] is None]
    lines = [
        f"Measured {meta['date']} on {meta['cpus']} CPU cores (1-minute load average "
        f"{meta['load_average_1m']:.1f} at the start), torch {v['torch']}, "
        f"deepspeed {v.get('deepspeed') or 'not installed'}, transformers {v.get('transformers')}, "
        f"python {meta['python']}; gloo, one thread per rank, every run in fresh processes with "
        f"MALLOC_MMAP_THRESHOLD_=1048576; {result['run_seconds']:.0f} s in all. fp32 AdamW "
        f"(lr {ADAMW['lr']:g}, weight decay {ADAMW['weight_decay']:g}) everywhere; {result['warmup']} "
        f"warm-up + {result['steps']} measured steps per run. Runtime (torch + gloo group, before "
        f"anything else): {_mb(min(runtimes, default=None))}-{_mb(max(runtimes, default=None))} MB RSS "
        "per rank.",
        "",
        *_single_run_command(result["rows"]),
    ]
    for name, text in result["workloads"].items():
        for world in result["worlds"]:
            rows = [r for r in result["rows"] if r["workload"] == name and r["world"] == world]
            if rows:  # none yet while the benchmark runs (the files are rewritten after every run)
                lines += [f"**{text}**, P = {rows[0]['psi']:,}, world {world}:", "", table(rows), ""]
    notes = [
        "MB = 1e6 bytes, largest rank, largest over the measured steps. At rest: RSS before a step's",
        "forward minus the baseline (the RSS after torch, the gloo group and the implementation's",
        "imports, before the model; 'imports' is that baseline minus the runtime's own). Formula: fp32",
        "AdamW model states (DDP 16P; stage 1 8P+8P/N; stage 2 4P+12P/N; stage 3, FSDP2 16P/N); it",
        "counts the gradients, which an implementation that frees them after the step (FSDP2, torch's",
        "zero_grad(set_to_none=True)) holds only during the step: compare its step peak.",
        "Forward holds: RSS after forward minus at rest (activations and whatever gathered",
        "parameters forward still holds when backward starts). Step peak: VmHWM of the step (reset",
        "before its forward) minus the baseline = at rest + what the step added at its peak;",
        "backward / optimizer step add: the peak of each phase (VmHWM reset before it) minus at rest",
        "(the step peak is the largest of forward's, backward's and the optimizer step's). Model",
        "states counted: distinct storages reachable from the implementation's module, optimizer",
        "and engine after backward (a second figure). Stage 3 (zero, DeepSpeed): persistence",
        "threshold 0, prefetch 1 block, at most 2 blocks live, reuse distance 0. Every stage (zero",
        "and DeepSpeed): reduce and all-gather buckets of 1 block, sub_group_size 1 block.",
        "Rows '+defaults': only the stage given (zero's defaults: sizes from the model's largest",
        "parameter, persistence threshold 1e5); '+dsdefaults': the stage and DeepSpeed's default",
        "sizes given (reduce/all-gather buckets 5e8, sub_group_size 1e9, prefetch 5e7, live",
        "parameters and reuse distance 1e9). FSDP2: fully_shard on each block and the root, its",
        "defaults; DDP: gradient_as_bucket_view=True.",
    ]
    lines.append(" ".join(notes))
    runs = _runs(result["rows"])
    if len(runs) > 1:  # rows merged from several runs (--merge): say which run measured which row
        said = []
        for date, rows in runs.items():
            names = ", ".join(f"{r['impl']} ({r['workload']}, world {r['world']})" for r in rows)
            said.append(f"{date} by {_command_of(rows)}: {names}")
        lines += ["", "Rows merged from several runs (`--merge`), measured on " + "; ".join(said) + "."]
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


def _runs(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows by the run that measured them (its date), oldest first: several after ``--merge``.

    Rows of files written before rows carried a date are one run (``--merge`` dates them).
    """
    runs: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r.get("date", "")):
        runs.setdefault(row.get("date", ""), []).append(row)
    return runs


def _command_of(rows: list[dict[str, Any]]) -> str:
    """The command of the run that measured ``rows`` (rows of files written before rows carried
    their command: not recorded)."""
    command = rows[0].get("command")
    return f"`{command}`" if command else "(command not recorded)"


def _single_run_command(rows: list[dict[str, Any]]) -> list[str]:
    """The report's "Command:" line when one run measured every row (merged runs name theirs below)."""
    runs = list(_runs(rows).values())
    return [f"Command: {_command_of(runs[0])}", ""] if len(runs) == 1 else []


def plot(result: dict[str, Any], out: pathlib.Path, stem: str) -> list[pathlib.Path]:
    """Per workload and world: at rest and the step's peak above the baseline, the formula marked."""
    plt = pyplot()

    names, worlds = list(result["workloads"]), result["worlds"]
    fig, axes = plt.subplots(
        len(names), len(worlds), figsize=(6 * len(worlds), 3.8 * len(names)), squeeze=False
    )
    for i, name in enumerate(names):
        for j, world in enumerate(worlds):
            ax = axes[i][j]
            rows = [r for r in result["rows"] if r["workload"] == name and r["world"] == world]
            ok = [r for r in rows if r["error"] is None]
            xs = range(len(ok))
            rest = [r["rest_bytes"] / 1e6 for r in ok]
            added = [r["peak_added_bytes"] / 1e6 for r in ok]
            ax.bar(xs, rest, 0.7, label="at rest")
            bars = ax.bar(xs, added, 0.7, bottom=rest, alpha=0.45, label="added by the step (peak)")
            ax.bar_label(bars, labels=[f"{a + b:.0f}" for a, b in zip(rest, added)], fontsize=7)
            ax.scatter(
                xs,
                [r["formula_bytes"] / 1e6 for r in ok],
                color="black",
                marker="_",
                s=300,
                zorder=3,
                label="ZeRO formula",
            )
            ax.set_xticks(list(xs), [r["impl"] for r in ok], rotation=30, fontsize=8)
            ax.set_ylabel("MB per rank above the baseline")
            ax.margins(y=0.2)  # room for the bar labels and the legend
            ax.set_title(f"{name}, world {world}", fontsize=10)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle("Real memory per rank (RSS, fresh processes, fp32 AdamW)")
    return [save_figure(fig, out / f"{stem}.png")]


# ----------------------------------------------------------------------------- main


def merge_results(previous: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the rows of ``previous`` it did not measure again (``--merge``).

    A row is one (implementation, workload, world); each keeps the date it was measured on
    (rows of files written before rows carried one get the previous file's date). Rows are
    ordered by workload, world and :data:`IMPLS`; the workloads, worlds and implementations are
    the union of both; ``run_seconds`` is the sum.
    """
    key = lambda r: (r["impl"], r["workload"], r["world"])  # noqa: E731
    done = {key(r) for r in new["rows"]}
    kept = [
        dict(r, date=r.get("date", previous["meta"]["date"])) for r in previous["rows"] if key(r) not in done
    ]
    workloads = {**previous["workloads"], **new["workloads"]}
    shapes = {**previous.get("workload_shapes", {}), **new["workload_shapes"]}
    worlds = sorted({*previous["worlds"], *new["worlds"]})
    order = {name: i for i, name in enumerate(workloads)}
    rank = {impl: i for i, impl in enumerate(IMPLS)}
    rows = sorted(
        kept + new["rows"], key=lambda r: (order[r["workload"]], r["world"], rank.get(r["impl"], len(IMPLS)))
    )
    impls = [i for i in IMPLS if i in {*previous["impls"], *new["impls"]}]
    return dict(
        new,
        workloads=workloads,
        workload_shapes=shapes,
        worlds=worlds,
        impls=impls,
        rows=rows,
        run_seconds=previous.get("run_seconds", 0.0) + new["run_seconds"],
    )


def run_all(
    impls: list[str], workloads: dict[str, Workload], args: argparse.Namespace, report: Any
) -> list[dict[str, Any]]:
    """Every implementation x workload x world in fresh ranks; one row each (failed runs named).

    ``report(rows)`` is called after every run, so the result files hold every run so far.
    """
    rows: list[dict[str, Any]] = []
    for name, w in workloads.items():
        psi = count_params(w)
        for world in args.worlds:
            for impl in impls_for(impls, w):
                run = Run(impl, w, world, args.warmup, args.steps, args.timeout)
                t0 = time.monotonic()
                try:
                    ranks = spawn_ranks(rank_main, world, run, args.timeout)
                    row = summarize(impl, name, world, psi, ranks)
                    done = f"rest {_mb(row['rest_bytes'])} MB, step peak {_mb(row['step_peak_bytes'])} MB"
                except (RuntimeError, TimeoutError) as exc:
                    row = failed_row(impl, name, world, psi, str(exc))
                    done = f"FAILED: {exc}"
                rows.append(row)
                report(rows)
                print(f"  {name} world {world} {impl}: {done} ({time.monotonic() - t0:.0f} s)", flush=True)
    return rows


def build_parser() -> BenchmarkParser:
    parser = benchmark_parser("memory", __doc__, docs=True)
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument(
        "--medium", action="store_true", help="5 x 2048^2 Linear stack, 4-block GPT-2 of width 512"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one run may take")
    parser.add_argument("--name", default="memory", help="result file stem (default memory)")
    parser.add_argument(
        "--render", type=pathlib.Path, default=None, help="only rewrite md/png from this json"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of an existing <out>/<name>.json that this run does not measure again",
    )
    return parser


def _report(result: dict[str, Any], name: str) -> Report:
    text = markdown(result)
    return Report(name, result, f"# Memory benchmark\n\n{text}", plot=plot, block=BLOCK, docs_text=text)


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.render is not None:
        result = json.loads(args.render.read_text())
        _report(result, args.name).write(args.out, args.docs)
        print(markdown(result))
        return
    impls = list(args.impls)
    if importlib.util.find_spec("deepspeed") is None:
        dropped = [i for i in impls if i.startswith("deepspeed")]
        impls = [i for i in impls if not i.startswith("deepspeed")]
        print(f"deepspeed is not installed: skipping {dropped}", file=sys.stderr)
    table_of = QUICK_WORKLOADS if args.quick else MEDIUM_WORKLOADS if args.medium else WORKLOADS
    workloads = {name: table_of[name] for name in args.workloads}
    command = command_line("memory", argv)  # as typed: the benchmark sets MEASURED_ENV itself
    os.environ.update(MEASURED_ENV)  # inherited by every spawned rank (glibc reads it at start-up)
    env = environment("deepspeed", "transformers", "matplotlib", "zero-full", "zero-optim", "zero-params")
    print(
        f"memory: {len(impls)} implementations x {len(workloads)} workloads x worlds {args.worlds}",
        flush=True,
    )
    start = time.monotonic()
    previous = None
    if args.merge and (args.out / f"{args.name}.json").exists():
        previous = json.loads((args.out / f"{args.name}.json").read_text())

    def report(rows: list[dict[str, Any]]) -> str:
        for row in rows:
            row.setdefault("date", env["date"])
            row.setdefault("command", command)
        result = {
            "meta": env,
            "env": MEASURED_ENV,
            "quick": args.quick,
            "workloads": {name: w.describe() for name, w in workloads.items()},
            "workload_shapes": {name: dataclasses.asdict(w) for name, w in workloads.items()},
            "worlds": args.worlds,
            "impls": impls,
            "warmup": args.warmup,
            "steps": args.steps,
            "release_policy": dataclasses.asdict(RELEASE),
            "run_seconds": time.monotonic() - start,
            "rows": rows,
        }
        if previous is not None:
            result = merge_results(previous, result)
        _report(result, args.name).write(args.out, args.docs)
        return markdown(result)

    print(report(run_all(impls, workloads, args, report)))
