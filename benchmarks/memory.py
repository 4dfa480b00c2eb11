"""Real memory per rank: DDP, FSDP2, DeepSpeed and zero stages 1/2/3, each in fresh processes.

Run from the repository root (``python -m nox -s bench`` does, with every dependency)::

    python benchmarks/memory.py --out benchmarks/results [--quick] [--name memory] [--docs docs]

For each workload (a stack of bias-free ``Linear`` layers where parameters dominate, and a
``transformers`` GPT-2 of comparable size; ``--quick``: small ones), each world size
(``--worlds``, default 2 and 4) and each implementation (``ddp``, ``fsdp2``, ``deepspeed-1/2/3``,
``zero-1/2/3``, ``zero-3+ckpt``, zero stage 3 with activation checkpointing of every block, and
``zero-3+leaf``, zero stage 3 gathering each GPT-2 block as one leaf, as the speed benchmarks do; GPT-2 only),
the launcher spawns ``W`` FRESH gloo ranks (``_report.spawn_ranks``) with
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
   storages (``impls.model_state_bytes``: a second figure, not the evidence).

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
``memory-benchmark`` markers. Each row records the command that measured it (``_report.command_line``:
the arguments and any ``MALLOC_*`` or thread variable set before the script sets its own), and
the report names it. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import sys
import time
import warnings
from typing import Any

from _report import (
    command_line,
    environment,
    markdown_table,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    spawn_ranks,
    write_results,
)
from impls import ImplOptions, formula_state_bytes, leaf_threshold
from workloads import ADAMW, Workload

IMPLS = (
    "ddp",
    "fsdp2",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
    "zero-1",
    "zero-2",
    "zero-3",
    "zero-3+ckpt",
    "zero-3+leaf",
)
# What a suffix of an implementation's name changes in RELEASE: activation checkpointing of every
# block; each GPT-2 block gathered as one leaf (the side-by-side's stage3_module_granularity_threshold).
VARIANTS = {"+ckpt": {"checkpointing": True}, "+leaf": {"leaf_blocks": True}}
# Stage 3 (zero and DeepSpeed) really releases: nothing persists, one block prefetched, two live.
# Every stage (zero and DeepSpeed alike) bounds its transients by the config: reduce / all-gather
# buckets of one block and an optimizer that steps one block's elements at a time; overlap_comm
# and zero's reduce_max_inflight at each implementation's default (overlap_comm false at stage 2,
# true at stage 3; one reduction in flight); stage 3 gathers per module (no granularity threshold).
RELEASE = ImplOptions(
    persistence_threshold=0,
    prefetch_blocks=1.0,
    live_blocks=2.0,
    bucket_blocks=1.0,
    sub_group_blocks=1.0,
    overlap_comm=None,
    leaf_blocks=False,
    reduce_max_inflight=None,
)
MEASURED_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
MARK_BEGIN = "<!-- memory-benchmark:begin -->"
MARK_END = "<!-- memory-benchmark:end -->"

WORKLOADS = {
    # >= 100M parameters, parameters dominate: 6 x 4096^2 = 100.7M, two rows per rank.
    "linear": Workload("linear", layers=6, hidden=4096, micro_batch=2),
    # GPT-2 of comparable size: 8 blocks x 12 x 1024^2 + embeddings = 109M, one 64-token sequence.
    "gpt2": Workload("gpt2", layers=8, hidden=1024, heads=16, vocab=8192, seq=64, micro_batch=1),
}
QUICK_WORKLOADS = {
    "linear": Workload("linear", layers=4, hidden=1024, micro_batch=2),
    "gpt2": Workload("gpt2", layers=2, hidden=256, heads=4, vocab=4096, seq=32, micro_batch=1),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One implementation on one workload at one world size (what the ranks receive)."""

    impl: str
    workload: Workload
    world: int
    warmup: int
    steps: int
    timeout: float


def split_impl(impl: str) -> tuple[str, ImplOptions]:
    """The :data:`impls.IMPLEMENTATIONS` name and the options of a benchmark implementation name.

    ``zero-3+ckpt`` is ``zero-3`` with activation checkpointing, ``zero-3+leaf`` with each GPT-2
    block gathered as one leaf (:data:`VARIANTS`); every implementation gets the :data:`RELEASE`
    policy (only stage 3 reads it).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}: choose from {', '.join(IMPLS)}")
    base, plus, suffix = impl.partition("+")
    return base, dataclasses.replace(RELEASE, **VARIANTS.get(plus + suffix, {}))


def impls_for(impls: list[str], w: Workload) -> list[str]:
    """The implementations of ``impls`` that measure something of their own on ``w``.

    A variant asking for block leaves (``zero-3+leaf``) runs only where :func:`impls.leaf_threshold`
    sets a threshold (GPT-2: a Linear stack has no blocks); elsewhere it would be a second
    ``zero-3`` row.
    """
    kept = []
    for impl in impls:
        options = split_impl(impl)[1]
        if not options.leaf_blocks or leaf_threshold(w, options) is not None:
            kept.append(impl)
    return kept


def formula_bytes(impl: str, psi: int, world: int) -> float:
    """The fp32 AdamW ZeRO formula of ``impl`` (checkpointing changes activations, not model states)."""
    return formula_state_bytes(split_impl(impl)[0], psi, world)


# ----------------------------------------------------------------------------- one rank


def _import_libraries(impl: str, w: Workload) -> None:
    """Everything the implementation imports before it builds the model (part of the baseline).

    ``torch._dynamo`` (about 140 MB of RSS) is imported by every implementation, lazily by DDP's
    and FSDP2's constructors: imported here, it is part of everyone's baseline.
    """
    names = ["torch._dynamo", *(["torch.distributed.fsdp"] if impl == "fsdp2" else [])]
    if w.kind == "gpt2":
        names += [
            "transformers.models.gpt2.modeling_gpt2",
            "zero_full.cli.train.workloads",
        ]  # the model's builder
    if impl.startswith("deepspeed"):
        names.append("deepspeed")
    if impl.startswith("zero"):
        names.append("zero_full")
    for name in names:
        importlib.import_module(name)


def _settle() -> int:
    """RSS after a garbage collection (no cycle left holding tensors)."""
    gc.collect()
    return rss_bytes()


def _measure(run: Run, rank: int) -> dict[str, Any]:
    """Steps 1-5 of the module docstring on this rank (the process group is up)."""
    import torch.distributed as dist
    from impls import IMPLEMENTATIONS, model_state_bytes
    from workloads import global_batch, rank_slice

    w, world = run.workload, run.world
    dist.barrier()  # gloo's connections are open: the runtime is complete
    runtime = _settle()
    _import_libraries(run.impl, w)
    baseline = _settle()
    base, options = split_impl(run.impl)
    runner = IMPLEMENTATIONS[base](w, world, options)
    total = run.warmup + run.steps + 1
    batches = [rank_slice(global_batch(w, s, world), rank, world) for s in range(total)]
    for s in range(run.warmup):
        runner.forward_backward(batches[s])
        runner.optimizer_step()
    steps = []
    for s in range(run.warmup, run.warmup + run.steps):
        dist.barrier()
        rest = _settle()
        reset_peak_rss()
        start = time.perf_counter()
        loss = runner.forward(batches[s])
        forward = rss_bytes()
        forward_peak = peak_rss_bytes()
        reset_peak_rss()  # VmHWM restarts at the current RSS: each phase's peak, the step's is their max
        runner.backward(loss)
        backward_peak = peak_rss_bytes()
        reset_peak_rss()
        runner.optimizer_step()
        step_peak = peak_rss_bytes()
        seconds = time.perf_counter() - start  # growth.py's step time (the peak readings included)
        steps.append(
            {
                "rest": rest,
                "forward": forward,
                "peak": max(forward_peak, backward_peak, step_peak),
                "backward_peak": backward_peak,
                "optimizer_peak": step_peak,
                "loss": loss.item(),
                "seconds": seconds,
            }
        )
        del loss
    runner.forward_backward(batches[-1])
    state = model_state_bytes(runner)
    runner.optimizer_step()
    runner.close()
    return rank_figures(rank, runtime, baseline, steps, state)


def rank_figures(
    rank: int, runtime: int, baseline: int, steps: list[dict[str, Any]], state: int
) -> dict[str, Any]:
    """One rank's figures as :func:`summarize` reads them (``steps``: one dict per measured step)."""
    return {
        "rank": rank,
        "runtime": runtime,
        "baseline": baseline,
        "steps": steps,
        "model_state_bytes": state,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def _rank_main(rank: int, run: Run, store: str, results: Any) -> None:
    """Process entry of one rank: measure, gather every rank's figures, rank 0 reports them."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(run.world),
        LOCAL_WORLD_SIZE=str(run.world),
        MASTER_ADDR="127.0.0.1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    timeout = datetime.timedelta(seconds=run.timeout)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=run.world, timeout=timeout
    )
    mine = _measure(run, rank)
    gathered: list[Any] = [None] * run.world
    dist.all_gather_object(gathered, mine)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(gathered)


# ----------------------------------------------------------------------------- aggregation


def summarize(impl: str, workload: str, world: int, psi: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from every rank's figures: the largest rank's, over the measured steps.

    rest = RSS at rest - baseline; forward = what forward added and held; peak_added = peak
    RSS of the step - its rest; step_peak = rest + peak_added (the step's peak above the
    baseline); imports = baseline - runtime.
    """

    def worst(value: Any) -> int:
        return max(value(r, s) for r in ranks for s in r["steps"])

    def phase_added(key: str) -> int | None:
        # backward / optimizer-step peaks: recorded by this script's ranks, not by every caller's
        if all(key in s for r in ranks for s in r["steps"]):
            return worst(lambda r, s: s[key] - s["rest"])
        return None

    rest = worst(lambda r, s: s["rest"] - r["baseline"])
    return {
        "impl": impl,
        "workload": workload,
        "world": world,
        "psi": psi,
        "runtime_bytes": max(r["runtime"] for r in ranks),
        "imports_bytes": max(r["baseline"] - r["runtime"] for r in ranks),
        "rest_bytes": rest,
        "forward_bytes": worst(lambda r, s: s["forward"] - s["rest"]),
        "peak_added_bytes": worst(lambda r, s: s["peak"] - s["rest"]),
        "backward_added_bytes": phase_added("backward_peak"),
        "optimizer_added_bytes": phase_added("optimizer_peak"),
        "step_peak_bytes": worst(lambda r, s: s["peak"] - r["baseline"]),
        "formula_bytes": formula_bytes(impl, psi, world),
        "model_state_bytes": max(r["model_state_bytes"] for r in ranks),
        "error": None,
    }


def failed_row(impl: str, workload: str, world: int, psi: int, error: str) -> dict[str, Any]:
    """The row of a run that did not finish (a dead rank, a timeout): its error, no figures."""
    return {"impl": impl, "workload": workload, "world": world, "psi": psi, "error": error}


def count_params(w: Workload) -> int:
    """P of the workload's model, built on the meta device (no memory, no time)."""
    import torch
    from workloads import build_model, num_params

    with torch.device("meta"):
        return num_params(build_model(w))


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


def plot(result: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    """Per workload and world: at rest and the step's peak above the baseline, the formula marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def update_docs(docs: pathlib.Path, text: str, image: pathlib.Path) -> None:
    """Copy the plot to ``docs/assets/benchmarks`` and the tables into ``docs/memory.md``."""
    assets = docs / "assets" / "benchmarks"
    assets.mkdir(parents=True, exist_ok=True)
    shutil.copy2(image, assets / image.name)
    page = docs / "memory.md"
    content = page.read_text()
    begin, end = content.find(MARK_BEGIN), content.find(MARK_END)
    if begin < 0 or end < begin:
        raise RuntimeError(f"{page} has no {MARK_BEGIN} ... {MARK_END} section to hold the tables")
    plot_link = f"![Real memory per rank](assets/benchmarks/{image.name})\n"
    page.write_text(
        content[: begin + len(MARK_BEGIN)] + "\n\n" + plot_link + "\n" + text + "\n" + content[end:]
    )


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
                    ranks = spawn_ranks(_rank_main, world, run, args.timeout)
                    row = summarize(impl, name, world, psi, ranks)
                    done = f"rest {_mb(row['rest_bytes'])} MB, step peak {_mb(row['step_peak_bytes'])} MB"
                except (RuntimeError, TimeoutError) as exc:
                    row = failed_row(impl, name, world, psi, str(exc))
                    done = f"FAILED: {exc}"
                rows.append(row)
                report(rows)
                print(f"  {name} world {world} {impl}: {done} ({time.monotonic() - t0:.0f} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models (a smoke run of the script)")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one run may take")
    parser.add_argument("--name", default="memory", help="result file stem (default memory)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--docs", type=pathlib.Path, default=None, help="docs dir for the plot and tables")
    parser.add_argument(
        "--render", type=pathlib.Path, default=None, help="only rewrite md/png from this json"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of an existing <out>/<name>.json that this run does not measure again",
    )
    args = parser.parse_args()
    if args.render is not None:
        result = json.loads(args.render.read_text())
        text = markdown(result)
        write_results(args.out, args.name, result, f"# Memory benchmark\n\n{text}")
        image = plot(result, args.out / f"{args.name}.png")
        if args.docs is not None:
            update_docs(args.docs, text, image)
        print(text)
        return
    impls = list(args.impls)
    if importlib.util.find_spec("deepspeed") is None:
        dropped = [i for i in impls if i.startswith("deepspeed")]
        impls = [i for i in impls if not i.startswith("deepspeed")]
        print(f"deepspeed is not installed: skipping {dropped}", file=sys.stderr)
    table_of = QUICK_WORKLOADS if args.quick else WORKLOADS
    workloads = {name: table_of[name] for name in args.workloads}
    command = command_line("memory.py")  # as typed: the script sets MEASURED_ENV itself
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
        text = markdown(result)
        write_results(args.out, args.name, result, f"# Memory benchmark\n\n{text}")
        image = plot(result, args.out / f"{args.name}.png")
        if args.docs is not None:
            update_docs(args.docs, text, image)
        return text

    print(report(run_all(impls, workloads, args, report)))


if __name__ == "__main__":
    main()
