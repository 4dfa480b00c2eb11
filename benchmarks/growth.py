"""Cost growth: step time and real memory against model size and world size, formula beside each point.

Run from the repository root (``python -m nox -s bench`` does)::

    python -m benchmarks growth [--sizes 1M 10M 100M] [--worlds 1 2 4]

For each model size (a stack of bias-free ``Linear`` layers, where parameters dominate: ~1M,
~10M, ~100M parameters), world size and implementation (DDP, FSDP2, zero stages 1-3), ``W``
FRESH gloo ranks are spawned and measured with :func:`benchmarks.kit.step_memory.measure_rank`
(``MALLOC_MMAP_THRESHOLD_`` set, RSS at rest above the post-import baseline, the step's peak
RSS), with each measured step also timed (per step the slowest rank, the median). Stage 3 runs
with the memory benchmark's release policy. Beside each point:

* memory: the fp32 AdamW ZeRO formula (DDP 16P, stage 1 8P + 8P/N, stage 2 4P + 12P/N, stage 3
  and FSDP2 16P/N);
* time: ``compute + ring-ideal bytes x cost per byte``, where ``compute`` is DDP's step at world 1
  for that size (the per-rank micro-batch is the same at every world size) and the cost per byte
  is fitted on an all-gather / all-to-all sweep at that world size (:func:`benchmarks.kit.wire.comm_sweep`).

Writes ``growth.json``, ``growth.md`` and ``growth.png`` into ``--out``; with ``--docs DIR`` the
table and plot go into ``DIR/benchmarks.md``'s ``growth`` block. Not a test.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.docs import DocsBlock
from benchmarks.kit.impls import ring_ideal_bytes
from benchmarks.kit.measure import spawn_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table, pyplot, save_figure
from benchmarks.kit.step_memory import MEASURED_ENV, Run, count_params, measure_rank, summarize
from benchmarks.kit.workloads import Workload

IMPLS = ("ddp", "fsdp2", "zero-1", "zero-2", "zero-3")
SIZES = {
    "1M": Workload("linear", layers=4, hidden=512, micro_batch=2),  # 1.05M
    "10M": Workload("linear", layers=4, hidden=1600, micro_batch=2),  # 10.2M
    "100M": Workload("linear", layers=6, hidden=4096, micro_batch=2),  # 100.7M
}
BLOCK = DocsBlock("benchmarks.md", "growth")


# ----------------------------------------------------------------------------- ranks


def _rank_main(rank: int, run: Run, store: str, results: Any) -> None:
    """:func:`measure_rank` on every rank (its steps are timed too); rank 0 reports them all."""
    import torch.distributed as dist

    mine = measure_rank(run, rank)
    gathered: list[Any] = [None] * run.world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        results.put(gathered)


def _sweep_main(rank: int, args: tuple[int, float], store: str, results: Any) -> None:
    from benchmarks.kit.wire import comm_sweep, fit_cost

    world, _ = args
    rows = comm_sweep(world, repeats=3)
    if rank == 0:
        results.put(fit_cost(rows))


# ----------------------------------------------------------------------------- report


def point(impl: str, size: str, world: int, psi: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Memory columns from :func:`memory.summarize`, plus the median step time of the slowest rank."""
    row = summarize(impl, size, world, psi, ranks)
    per_step = [max(r["steps"][i]["seconds"] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    row["step_s"] = statistics.median(per_step)
    return row


def predict(rows: list[dict[str, Any]], costs: dict[int, float]) -> None:
    """Fill ``predicted_step_s``: DDP's world-1 step of the size + ring-ideal bytes x cost per byte."""
    compute = {r["workload"]: r["step_s"] for r in rows if r["impl"] == "ddp" and r["world"] == 1}
    for r in rows:
        base = compute.get(r["workload"])
        cost = costs.get(r["world"], 0.0)
        wire = ring_ideal_bytes(r["impl"], r["psi"], r["world"])
        r["predicted_step_s"] = None if base is None else base + wire * cost


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for r in result["rows"]:
        pred = r.get("predicted_step_s")
        rows.append(
            (
                r["workload"],
                f"{r['psi'] / 1e6:.1f}M",
                r["world"],
                r["impl"],
                f"{r['step_s'] * 1e3:.1f}",
                "-" if pred is None else f"{pred * 1e3:.1f}",
                f"{r['rest_bytes'] / 1e6:.1f}",
                f"{r['formula_bytes'] / 1e6:.1f}",
                f"{r['step_peak_bytes'] / 1e6:.1f}",
            )
        )
    costs = ", ".join(f"world {w}: {c * 1e9:.3f} ns/B" for w, c in result["cost_s_per_byte"].items())
    headers = [
        "size",
        "P",
        "world",
        "impl",
        "step ms",
        "predicted ms",
        "rest MB",
        "formula MB",
        "step peak MB",
    ]
    return "\n".join(
        [
            f"Cost growth ({result['meta']['label']}). Command: `{result['meta']['command']}`. "
            f"Gloo cost per byte (fit): {costs or 'world 1 only'}.",
            "",
            markdown_table(headers, rows, "lrrlrrrrr"),
            "",
            "step ms: median over the measured steps of the slowest rank. predicted: DDP's world-1 step "
            "of the same size + ring-ideal bytes (2P(N-1)/N x 4, 3P(N-1)/N x 4 for stage 3 and FSDP2) "
            "x cost per byte. rest / step peak: RSS above the post-import baseline, largest rank "
            "(fresh processes, MALLOC_MMAP_THRESHOLD_=1048576); formula: fp32 AdamW ZeRO formula.",
        ]
    )


def plot(result: dict[str, Any], out: pathlib.Path, stem: str) -> list[pathlib.Path]:
    """Step time and RSS at rest against P, one line per implementation and world, formula dashed."""
    plt = pyplot()

    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["rows"]
    colors = dict(zip(IMPLS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    markers = {1: "o", 2: "s", 4: "^"}
    for impl in IMPLS:
        for world in sorted({r["world"] for r in rows}):
            pts = sorted(
                (r for r in rows if r["impl"] == impl and r["world"] == world), key=lambda r: r["psi"]
            )
            if not pts:
                continue
            xs = [r["psi"] for r in pts]
            style = {"color": colors[impl], "marker": markers.get(world, "D")}
            t_ax.plot(xs, [r["step_s"] * 1e3 for r in pts], label=f"{impl} W={world}", **style)
            pred = [r["predicted_step_s"] for r in pts]
            if all(p is not None for p in pred):
                t_ax.plot(xs, [p * 1e3 for p in pred], ls="--", mfc="none", alpha=0.6, **style)
            m_ax.plot(xs, [r["rest_bytes"] / 1e6 for r in pts], **style)
            m_ax.plot(xs, [r["formula_bytes"] / 1e6 for r in pts], ls="--", mfc="none", alpha=0.6, **style)
    for ax, label in (
        (t_ax, "step ms (hollow, dashed: predicted)"),
        (m_ax, "RSS at rest MB (hollow, dashed: formula)"),
    ):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters P")
        ax.set_ylabel(label)
    t_ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"Cost growth ({result['meta']['label']})")
    return [save_figure(fig, out / f"{stem}.png")]


def build_parser() -> BenchmarkParser:
    parser = benchmark_parser(
        "growth",
        __doc__,
        quick={"sizes": ["1M"], "worlds": [1, 2], "warmup": 1, "steps": 2},
        docs=True,
        warmup=2,
        steps=4,
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--label", default="quiet machine")
    return parser


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    command = command_line("growth", argv)  # as typed: the benchmark sets MEASURED_ENV itself
    os.environ.update(MEASURED_ENV)  # inherited by every spawned rank (glibc reads it at start-up)
    worlds = sorted(set(args.worlds) | ({1} if "ddp" in args.impls else set()))  # world 1 DDP: compute
    costs = {
        w: spawn_ranks(_sweep_main, w, (w, args.timeout), args.timeout, process_group=True)[1]
        for w in worlds
        if w > 1
    }
    meta = environment("zero-full", "matplotlib")
    meta.update(label=args.label, command=command, env=MEASURED_ENV)
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        w = SIZES[size]
        psi = count_params(w)
        for world in worlds:
            for impl in args.impls:
                t0 = time.monotonic()
                ranks = spawn_ranks(
                    _rank_main,
                    world,
                    Run(impl, w, world, args.warmup, args.steps, args.timeout),
                    args.timeout,
                    process_group=True,
                )
                rows.append(point(impl, size, world, psi, ranks))
                print(
                    f"  {size} world {world} {impl}: {rows[-1]['step_s'] * 1e3:.1f} ms "
                    f"({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
    predict(rows, costs)
    result = {"meta": meta, "cost_s_per_byte": {str(k): v for k, v in costs.items()}, "rows": rows}
    text = markdown(result)
    Report("growth", result, text, plot=plot, block=BLOCK, docs_text=text).write(args.out, args.docs)
    print(text)
