"""Where one stage-3 step's time goes, and how far it is from the floor set by DDP and the wire.

Run from the repository root (``python -m nox -s bench`` does)::

    python -m benchmarks profile_step --docs docs

On ``--world`` gloo ranks (one thread each), with the side-by-side's GPT-2 workload:

1. **Cost per byte.** A small sweep of ``all_gather_single`` and ``all_to_all_single`` (how
   zero reduce-scatters) over a few sizes; a least-squares line ``t = latency + bytes x cost``
   over the ring-ideal bytes a rank sends gives gloo's cost per byte on this machine.
2. **DDP and zero stage 3, released** (``stage3_param_persistence_threshold`` 0 unless
   ``--persistence-threshold`` says otherwise — 4096 is the paired and side-by-side benchmarks'
   setting, which keeps biases and norms whole —, live / prefetch bounds of 1.5 / 0.5 blocks,
   reuse distance 0: every other parameter is gathered and freed per use): ``--steps`` timed
   steps, interleaved (each batch stepped by DDP, then by zero, so both see the same moments of
   a shared machine; per step the slowest rank; the median), and zero's wire bytes per step
   from the engine's ``CommLedger``.
3. **zero, profiled**:
   ``--profile-steps`` steps under ``torch.profiler`` (CPU): every event's self time on the
   training thread is attributed to the innermost category its ``record_function`` ranges
   name (compute forward / backward, collective calls, waiting for collectives, zero's copies
   and casts, hooks and coordinator, optimizer, ...), and the CPU time of every other thread
   (gloo's) is read from ``/proc/self/task``. Rank 0 writes a Chrome trace (``--trace``).
   DDP is profiled on the same batches, alternated step by step with zero, and
   :func:`op_differences` lists the ops (and zero's ranges) whose self time per step differs
   most between the two training threads: where zero's extra time goes, op by op.
   The waits for collectives are also listed in the order a step meets them
   (:func:`waits_in_order`), per rank: which ones are systematic (both ranks wait: a gather
   issued too late) and which are one rank waiting for the other.

``--impl zero-1`` / ``zero-2`` profiles those stages the same way instead (their wire bytes
are DDP's, so their floor is DDP's step).

The floor: ``DDP step + (stage-3 wire bytes - DDP's ring all-reduce bytes) x cost per byte``;
stage 3's distance to it is reported as a % of its step. Writes ``profile_step.json`` and
``profile_step.md`` into ``--out``; with ``--docs DIR`` the tables go into
``DIR/benchmarks.md``'s ``profile-step`` block. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.kit.cli import BenchmarkParser
from benchmarks.kit.docs import DocsBlock
from benchmarks.kit.impls import IMPLEMENTATIONS, ImplOptions, ring_ideal_bytes
from benchmarks.kit.measure import spawn_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from benchmarks.kit.wire import comm_sweep, fit_cost, slowest
from benchmarks.kit.workloads import Workload, count_params, rank_batches, workload_of, workload_parser

BLOCK = DocsBlock("benchmarks.md", "profile-step")
RELEASED = ImplOptions(persistence_threshold=0, prefetch_blocks=0.5, live_blocks=1.5)
"""The stage-3 options profiled (``--persistence-threshold`` replaces the threshold)."""
COPY_OPS = {
    "aten::copy_",
    "aten::cat",
    "aten::_to_copy",
    "aten::to",
    "aten::split_with_sizes_copy",
    "aten::clone",
    "aten::zero_",
    "aten::fill_",
    "aten::zeros",
    "aten::add_",
    "aten::div_",
    "aten::add",
}
CATEGORIES = (
    "compute forward",
    "compute backward",
    "collective calls (issue / synchronous)",
    "waiting for collectives",
    "zero copies / casts / local sums",
    "hooks and coordinator (Python)",
    "optimizer",
    "step: other (zero_grad, checks)",
    "other",
)


# ----------------------------------------------------------------------------- attribution


ZERO_TOP, DDP_TOP = "bench.step", "bench.ddp_step"
"""The ranges around one profiled zero step and one profiled DDP step."""


def _is_wait(name: str) -> bool:
    """Whether a range is one of zero's waits for a collective (``zero.*.wait``)."""
    return name.startswith("zero.") and name.endswith(".wait")


def _category(chain: list[str]) -> str:
    """The category of an event's self time; ``chain`` = its name, then its ancestors' names."""
    own = chain[0]
    if own.startswith(("c10d::", "gloo")) or "record_param_comms" in own:
        return "collective calls (issue / synchronous)"
    if _is_wait(own):
        return "waiting for collectives"
    zero_inner = next((n for n in chain if n.startswith("zero.") and not n.startswith("zero.engine.")), None)
    in_optim = zero_inner is not None and zero_inner.startswith(("zero.optim.step", "zero.optim.sub_group"))
    if own in COPY_OPS and zero_inner is not None and not in_optim:
        return "zero copies / casts / local sums"
    for name in chain:
        if name.startswith(("zero.optim.step", "zero.optim.sub_group_step")):
            return "optimizer"
        if name.startswith(
            ("zero.coord.", "zero.params.", "zero.all_gather", "zero.reduce_scatter", "zero.optim.")
        ):
            return "hooks and coordinator (Python)"
        if name == "zero.engine.forward":
            return "compute forward"
        if name == "zero.engine.backward":
            return "compute backward"
        if name == "zero.engine.step":
            return "step: other (zero_grad, checks)"
    return "other"


def breakdown(events: Any, steps: int) -> dict[str, float]:
    """Milliseconds per step per category, from the training thread's events under ``bench.step``."""
    tops = [e for e in events if e.name == ZERO_TOP]
    if not tops:
        return {}
    thread = tops[0].thread
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        if e.thread != thread:
            continue
        chain, node = [], e
        while node is not None:
            chain.append(node.name)
            node = node.cpu_parent
        if ZERO_TOP not in chain:
            continue
        if e.name == ZERO_TOP:
            totals["other"] += e.self_cpu_time_total
            continue
        totals[_category(chain)] += e.self_cpu_time_total
    return {k: v / 1e3 / steps for k, v in totals.items()}


def op_self_ms(events: Any, top: str, steps: int) -> dict[str, float]:
    """Self time per step (ms) of every event name on the training thread under the ``top`` ranges.

    The training thread is the one the first ``top`` range ran on; the ``top`` ranges themselves
    (the benchmark's loop) are left out. A range's self time is its time outside its children:
    for zero's ranges that is Python and the waits it does not range separately.
    """
    tops = [e for e in events if e.name == top]
    if not tops or steps <= 0:
        return {}
    thread = tops[0].thread
    totals: dict[str, float] = {}
    for e in events:
        if e.thread != thread or e.name == top:
            continue
        node = e.cpu_parent
        while node is not None and node.name != top:
            node = node.cpu_parent
        if node is None:
            continue
        totals[e.name] = totals.get(e.name, 0.0) + e.self_cpu_time_total
    return {k: v / 1e3 / steps for k, v in totals.items()}


def op_differences(zero: dict[str, float], ddp: dict[str, float], top: int = 15) -> list[dict[str, Any]]:
    """The ``top`` names whose self time per step differs most between zero and DDP (largest first).

    Each row: ``name``, ``zero_ms``, ``ddp_ms``, ``diff_ms`` (zero minus DDP: positive is time
    zero spends that DDP does not). Ties keep the name order, so the table is stable.
    """
    rows = [
        {"name": n, "zero_ms": zero.get(n, 0.0), "ddp_ms": ddp.get(n, 0.0)} for n in sorted({*zero, *ddp})
    ]
    for r in rows:
        r["diff_ms"] = r["zero_ms"] - r["ddp_ms"]
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return rows[:top]


def differences_table(rows: list[dict[str, Any]], zero_total: float, ddp_total: float) -> str:
    """:func:`op_differences` as a markdown table, with the whole thread's totals last."""
    if not rows:
        return ""
    body = [
        [f"`{r['name']}`", f"{r['zero_ms']:.2f}", f"{r['ddp_ms']:.2f}", f"{r['diff_ms']:+.2f}"] for r in rows
    ]
    body.append(
        [
            "**all events of the step**",
            f"{zero_total:.1f}",
            f"{ddp_total:.1f}",
            f"{zero_total - ddp_total:+.1f}",
        ]
    )
    return markdown_table(["op or range", "zero ms / step", "DDP ms / step", "zero - DDP"], body, "lrrr")


def waits_in_order(events: Any) -> list[dict[str, Any]]:
    """The collective waits of a step in the order they come, each position over the profiled steps.

    On the training thread, every outermost ``zero.*.wait`` range under each ``bench.step``:
    its start within the step and its duration. Position ``k`` is the ``k``-th wait of every
    step (steady steps wait at the same places; with unequal counts only the first ``n`` of
    every step, ``n`` the least). Per position: the phase (``forward`` / ``backward`` /
    ``step``: the innermost ``zero.engine.*`` range around it), the range's name, the median
    start (ms into the step) and the median, mean and largest wait (ms).
    """
    tops = sorted((e for e in events if e.name == ZERO_TOP), key=lambda e: e.time_range.start)
    if not tops:
        return []
    thread = tops[0].thread
    index = {id(e): i for i, e in enumerate(tops)}
    per_step: list[list[tuple[float, float, str, str]]] = [[] for _ in tops]
    for e in events:
        if e.thread != thread or not _is_wait(e.name):
            continue
        phase, node, top = "other", e.cpu_parent, None
        while node is not None:
            if _is_wait(node.name):
                break  # nested in another wait: counted there
            if phase == "other" and node.name.startswith("zero.engine."):
                phase = node.name.removeprefix("zero.engine.")
            if id(node) in index:
                top = node
            node = node.cpu_parent
        if node is not None or top is None:
            continue
        start = (e.time_range.start - top.time_range.start) / 1e3
        per_step[index[id(top)]].append((start, e.time_range.elapsed_us() / 1e3, e.name, phase))
    for waits in per_step:
        waits.sort()
    rows = []
    for k in range(min(len(w) for w in per_step)):
        at = [w[k] for w in per_step]
        took = [a[1] for a in at]
        rows.append(
            {
                "position": k,
                "phase": at[0][3],
                "range": at[0][2],
                "start_ms": statistics.median(a[0] for a in at),
                "wait_ms": statistics.median(took),
                "mean_ms": statistics.fmean(took),
                "max_ms": max(took),
            }
        )
    return rows


def _thread_cpu_seconds() -> dict[int, float]:
    """utime + stime of every thread of this process (seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


# ----------------------------------------------------------------------------- measuring


def _timed_steps(runners: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Each batch stepped by every runner in turn (interleaved: they share the machine's moments).

    Per runner: the median step (per step the slowest rank); for a runner with an engine, its
    wire bytes per step from the engine's ``CommLedger``.
    """
    times: dict[str, list[float]] = {name: [] for name in runners}
    wire: dict[str, list[int]] = {name: [] for name in runners}
    for batch in batches:
        for name, runner in runners.items():
            dist.barrier()
            t = time.perf_counter()
            runner.forward_backward(batch)
            runner.optimizer_step()
            times[name].append(slowest(time.perf_counter() - t))
            engine = getattr(runner, "engine", None)
            if engine is not None:
                wire[name].append(engine.stats.comm.wire_bytes)
    return {
        name: {"step_s": statistics.median(times[name]), "steps_s": times[name], "wire_bytes": wire[name]}
        for name in runners
    }


def _profiled(
    runner: Any, ddp: Any, batches: list[dict[str, torch.Tensor]], trace: pathlib.Path | None
) -> dict[str, Any]:
    """zero's steps under the profiler, each batch also stepped by DDP first (ranged apart).

    The wall time and the threads' CPU are zero's alone: DDP's steps are taken out of them.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    main = os.getpid()
    wall = 0.0
    cpu = {"main": 0.0, "others": 0.0}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            dist.barrier()
            with record_function(DDP_TOP):
                ddp.forward_backward(batch)
                ddp.optimizer_step()
            dist.barrier()
            before = _thread_cpu_seconds()
            t0 = time.perf_counter()
            with record_function(ZERO_TOP):
                runner.forward_backward(batch)
                runner.optimizer_step()
            wall += time.perf_counter() - t0
            after = _thread_cpu_seconds()
            cpu["main"] += after.get(main, 0.0) - before.get(main, 0.0)
            cpu["others"] += sum(v - before.get(k, 0.0) for k, v in after.items() if k != main)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    n, events = len(batches), prof.events()
    return {
        "profiled_step_ms": wall * 1e3 / n,
        "breakdown_ms": breakdown(events, n),
        "waits": waits_in_order(events),
        "zero_ops_ms": op_self_ms(events, ZERO_TOP, n),
        "ddp_ops_ms": op_self_ms(events, DDP_TOP, n),
        "other_threads_cpu_ms": cpu["others"] * 1e3 / n,
        "main_thread_cpu_ms": cpu["main"] * 1e3 / n,
    }


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: Any) -> None:
    try:
        os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
        torch.set_num_threads(1)
        world = args.world
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        w = _workload(args)
        total = args.warmup + args.steps + args.profile_steps
        batches = rank_batches(w, rank, world, total)
        warm, timed, prof = (
            batches[: args.warmup],
            batches[args.warmup : args.warmup + args.steps],
            batches[args.warmup + args.steps :],
        )
        sweep = comm_sweep(world, args.sweep_repeats)
        ddp = IMPLEMENTATIONS["ddp"](w, world)
        options = dataclasses.replace(RELEASED, persistence_threshold=args.persistence_threshold)
        zero = IMPLEMENTATIONS[args.impl](w, world, options)
        runners = {"ddp": ddp, "zero": zero}
        _timed_steps(runners, warm)
        timed_results = _timed_steps(runners, timed)
        ddp_result, zero_result = timed_results["ddp"], timed_results["zero"]
        trace = args.trace if rank == 0 else None
        profiled = _profiled(zero, ddp, prof, trace)
        ddp.close()
        zero.close()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, profiled)
        dist.destroy_process_group()
        if rank == 0:
            results.put({"sweep": sweep, "ddp": ddp_result, "zero3": zero_result, "profiled": gathered})
    except BaseException:
        results.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})


def _workload(args: argparse.Namespace) -> Workload:
    return workload_of(args)


# ----------------------------------------------------------------------------- report


def summarize(args: argparse.Namespace, raw: dict[str, Any], psi: int) -> dict[str, Any]:
    """Floor and distance from the raw per-rank measurements."""
    latency, cost = fit_cost(raw["sweep"])
    world = args.world
    ddp_s, zero_s = raw["ddp"]["step_s"], raw["zero3"]["step_s"]
    zero_wire = statistics.median(raw["zero3"]["wire_bytes"])
    ddp_wire = ring_ideal_bytes("ddp", psi, world)
    floor = ddp_s + (zero_wire - ddp_wire) * cost
    rank0 = raw["profiled"][0]
    return {
        "psi": psi,
        "world": world,
        "latency_s": latency,
        "cost_s_per_byte": cost,
        "ddp_step_s": ddp_s,
        "zero3_step_s": zero_s,
        "ddp_wire_bytes": ddp_wire,
        "zero3_wire_bytes": zero_wire,
        "floor_s": floor,
        "distance_pct_of_step": 100.0 * (zero_s - floor) / zero_s,
        "ratio_to_ddp": zero_s / ddp_s,
        "breakdown_ms": rank0["breakdown_ms"],
        "op_differences": op_differences(rank0.get("zero_ops_ms", {}), rank0.get("ddp_ops_ms", {})),
        "ops_total_ms": [
            sum(rank0.get("zero_ops_ms", {}).values()),
            sum(rank0.get("ddp_ops_ms", {}).values()),
        ],
        "waits": [p.get("waits", []) for p in raw["profiled"]],
        "profiled_step_ms": rank0["profiled_step_ms"],
        "other_threads_cpu_ms": [p["other_threads_cpu_ms"] for p in raw["profiled"]],
        "main_thread_cpu_ms": [p["main_thread_cpu_ms"] for p in raw["profiled"]],
    }


def waits_table(per_rank: list[list[dict[str, Any]]]) -> str:
    """The waits of a step in order (:func:`waits_in_order`), one column per rank (rank 0's positions)."""
    if not per_rank or not per_rank[0]:
        return ""
    ranks = range(len(per_rank))
    rows = []
    for k, first in enumerate(per_rank[0]):
        cells = []
        for waits in per_rank:
            w = waits[k] if k < len(waits) and waits[k]["range"] == first["range"] else None
            cells.append("-" if w is None else f"{w['wait_ms']:.2f} ({w['mean_ms']:.2f}, {w['max_ms']:.1f})")
        rows.append([str(k), first["phase"], f"`{first['range']}`", f"{first['start_ms']:.1f}", *cells])
    totals = [f"{sum(w['wait_ms'] for w in ws):.1f} ({sum(w['mean_ms'] for w in ws):.1f})" for ws in per_rank]
    rows.append(["", "**all**", "", "", *totals])
    return markdown_table(
        ["#", "phase", "range", "starts at (ms)", *[f"rank {r}: median (mean, max) ms" for r in ranks]],
        rows,
        "rllr" + "r" * len(per_rank),
    )


def markdown(result: dict[str, Any], docs: bool = False) -> str:
    """The results file's text; ``docs``: the docs block's, without the per-wait and per-op tables
    (the page points to the results file for them)."""
    s, meta = result["summary"], result["meta"]
    step = s["profiled_step_ms"]
    rows = [(k, f"{v:.1f}", f"{100 * v / step:.1f}%") for k, v in s["breakdown_ms"].items()]
    rows.append(("**profiled step (wall)**", f"{step:.1f}", "100%"))
    gloo = ", ".join(f"{v:.1f}" for v in s["other_threads_cpu_ms"])
    main = ", ".join(f"{v:.1f}" for v in s["main_thread_cpu_ms"])
    waits = "" if docs else waits_table(s.get("waits", []))
    differences = (
        "" if docs else differences_table(s.get("op_differences", []), *s.get("ops_total_ms", [0.0, 0.0]))
    )
    floor_rows = [
        ("DDP step (median of the slowest rank)", f"{s['ddp_step_s'] * 1e3:.1f} ms"),
        ("zero step, released", f"{s['zero3_step_s'] * 1e3:.1f} ms ({s['ratio_to_ddp']:.2f}x DDP)"),
        ("zero wire bytes / step (ledger)", f"{s['zero3_wire_bytes'] / 1e6:.2f} MB"),
        ("DDP wire bytes / step (ring all-reduce, 2P(N-1)/N x 4)", f"{s['ddp_wire_bytes'] / 1e6:.2f} MB"),
        (
            "gloo cost per byte (fit) / latency per call",
            f"{s['cost_s_per_byte'] * 1e9:.3f} ns/B / {s['latency_s'] * 1e6:.0f} us",
        ),
        ("floor = DDP + extra bytes x cost", f"{s['floor_s'] * 1e3:.1f} ms"),
        ("**zero's distance to the floor**", f"**{s['distance_pct_of_step']:.1f}% of its step**"),
    ]
    return "\n".join(
        [
            f"Profile of one {meta['impl']} step ({meta['label']}): {meta['workload']}, P = {s['psi']:,}, "
            f"world {s['world']}, gloo, fp32 AdamW, parameters released after use (persistence threshold "
            f"{meta.get('persistence_threshold', 0)}). Command: "
            f"`{meta['command']}`.",
            "",
            "Self time on the training thread of rank 0, per step, by the innermost `zero.*` range "
            "(profiler overhead included; the timed steps below are unprofiled):",
            "",
            markdown_table(["category", "ms / step", "% of step"], rows, "lrr"),
            "",
            f"CPU time of the other threads (gloo) per step, per rank: {gloo} ms; "
            f"training thread: {main} ms.",
            "",
            *(
                [
                    "The waits for collectives of a step, in order, over the profiled steps (start: "
                    "rank 0's median; a wait that is long on one rank only is that rank waiting for "
                    "the other):",
                    "",
                    waits,
                    "",
                ]
                if waits
                else []
            ),
            *(
                [
                    "Op by op, where zero's training thread spends its time differently from DDP's "
                    "(rank 0, the profiled batches stepped by DDP and zero in turn; self time under the "
                    "profiler, so a range's time outside its children, zero's waits included; the "
                    "largest differences first; time outside every event, such as a wait torch does "
                    "not record, is in neither column):",
                    "",
                    differences,
                    "",
                ]
                if differences
                else []
            ),
            markdown_table(["floor", "value"], floor_rows, "lr"),
        ]
    )


DEFAULTS = dict(world=2, warmup=3, steps=8, profile_steps=2, sweep_repeats=5)
QUICK = dict(warmup=1, steps=2, profile_steps=1, sweep_repeats=1)


def build_parser() -> BenchmarkParser:
    parser = workload_parser("profile_step", __doc__, quick=QUICK, docs=True, **DEFAULTS)
    parser.add_argument(
        "--impl",
        choices=("zero-1", "zero-2", "zero-3"),
        default="zero-3",
        help="the zero stage profiled (stages 1 and 2: the floor is DDP's step, same bytes)",
    )
    parser.add_argument(
        "--persistence-threshold",
        type=int,
        default=RELEASED.persistence_threshold,
        help="stage 3: parameters of at most this many elements stay whole (0: every one is released; "
        "4096: the paired and side-by-side benchmarks' setting)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--label", default="quiet machine", help="how loaded the machine was (in the table)")
    parser.add_argument(
        "--trace", type=pathlib.Path, default=pathlib.Path("benchmarks/results/tmp/profile_step_trace.json")
    )
    return parser


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    w = _workload(args)
    psi = count_params(w)
    print(f"profile_step: {w.describe()}, P = {psi:,}, world {args.world}", flush=True)
    raw = spawn_ranks(_rank_main, args.world, args, args.timeout)
    if "error" in raw:
        sys.exit(raw["error"])
    meta = environment("zero-full", "transformers")
    meta.update(
        label=args.label,
        impl=args.impl,
        persistence_threshold=args.persistence_threshold,
        workload=w.describe(),
        command=command_line("profile_step", argv),
        trace=str(args.trace),
    )
    result = {"meta": meta, "raw": raw, "summary": summarize(args, raw, psi)}
    text = markdown(result)
    Report(
        "profile_step", result, text, meta["command"], block=BLOCK, docs_text=markdown(result, docs=True)
    ).write(args.out, args.docs)
    print(text)
