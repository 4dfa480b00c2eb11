"""Benchmark generation under ZeRO-3: gathering per token (the hooks) vs gathered once.

Run from the repository root::

    python -m benchmarks generate

Spawns ``--world`` local gloo ranks, partitions a GPT-2 (``transformers``, random init) at
stage 3 and generates ``--new-tokens`` tokens greedily (with the KV cache) in two ways:

* **per token**: ``model.generate`` under ``torch.no_grad()``; the coordinator's hooks gather
  every layer for each forward, i.e. for each token;
* **gathered once**: inside ``engine.gathered_for_inference()``, which gathers the whole
  model with one coalesced all-gather, pauses the hooks, and releases on exit (the gather
  and release are inside the timed window).

Per way it reports the median wall time of the slowest rank over ``--repeats`` runs (after
one warm-up), tokens per second, and the all-gathers and bytes one generation issues (from a
``zero_comm.CommLedger``). Writes ``generate.json`` and ``generate.md`` into ``--out``. Not a
test: nothing is asserted. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.measure import ResultSink, spawn_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from benchmarks.kit.workloads import gpt2_of_width

WAYS = ("per token", "gathered once")


def tokens_per_second(batch: int, new_tokens: int, seconds: float) -> float:
    """Generated tokens (every sequence of the batch) per second of wall time."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return batch * new_tokens / seconds


def slowest_median(per_rank_times: list[list[float]]) -> float:
    """Median over runs of the slowest rank's time (runs are aligned by index across ranks)."""
    if not per_rank_times or any(len(t) != len(per_rank_times[0]) for t in per_rank_times):
        raise ValueError("every rank must report the same number of runs")
    return statistics.median(max(run) for run in zip(*per_rank_times, strict=True))


def summarize(rows: list[dict]) -> dict:
    """Speed-up of gathering once over per-token gathering, and all-gathers per generation each way."""
    by_way = {r["way"]: r for r in rows}
    per, once = by_way["per token"], by_way["gathered once"]
    return {
        "speedup": per["seconds_median"] / once["seconds_median"],
        "all_gathers_per_token_way": per["all_gathers"],
        "all_gathers_gathered_once": once["all_gathers"],
    }


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A GPT-2 LM (random init from seed 0, no dropout), eval mode."""
    positions = args.prompt + args.new_tokens
    workload = gpt2_of_width(args.layers, args.width, args.vocab, args.prompt, positions=positions)
    return workload.build_model().eval()


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run_ways(args: argparse.Namespace) -> list[dict]:
    """Both ways on this rank: per-run times (all ranks) and the ledger of one generation."""
    import zero_full
    from zero_comm import CommLedger, Topology

    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = zero_full.initialize(build_model(args), config, lambda ps: torch.optim.SGD(ps, lr=0.0))
    engine.eval()
    prompt = torch.randint(
        1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)
    )

    def generate() -> torch.Tensor:
        return engine.module.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip

    def per_token() -> torch.Tensor:
        with torch.no_grad():
            return generate()

    def once() -> torch.Tensor:
        with engine.gathered_for_inference():
            return generate()

    rows = []
    for way, fn in zip(WAYS, (per_token, once), strict=True):
        times = _timed(fn, args.repeats)
        ledger = CommLedger(Topology())
        with ledger:
            fn()
        gathers = [r for r in ledger.records if r.op == "all_gather"]
        all_times = [None] * dist.get_world_size()
        dist.all_gather_object(all_times, times)
        seconds = slowest_median(all_times)
        rows.append(
            {
                "way": way,
                "seconds_median": seconds,
                "tokens_per_second": tokens_per_second(args.batch, args.new_tokens, seconds),
                "all_gathers": len(gathers),
                "all_gather_payload_bytes": sum(r.payload_bytes for r in gathers),
            }
        )
    engine.close()
    return rows


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: ResultSink) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world)
    rows = run_ways(args)
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def report(args: argparse.Namespace, rows: list[dict], command: str) -> Report:
    """``generate.json`` (everything) and ``generate.md`` (a table)."""
    meta = {
        **environment("transformers"),
        **{k: v for k, v in vars(args).items() if k not in ("out", "quick")},
    }
    summary = summarize(rows)
    table = markdown_table(
        ["way", "ms / generation", "tokens / s", "all-gathers / generation", "gathered MB / generation"],
        [
            [
                r["way"],
                f"{r['seconds_median'] * 1e3:.0f}",
                f"{r['tokens_per_second']:.1f}",
                str(r["all_gathers"]),
                f"{r['all_gather_payload_bytes'] / 1e6:.2f}",
            ]
            for r in rows
        ],
        align="lrrrr",
    )
    lines = [
        f"# Generation under ZeRO-3, world {args.world}, gloo on CPU",
        "",
        f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens (greedy, KV cache). Median of {args.repeats} runs after one warm-up "
        f"(slowest rank). 1-min load {meta['load_average_1m']:.1f} at {meta['date']}.",
        "",
        table,
        "",
        f"Gathering once is {summary['speedup']:.2f}x the per-token way.",
    ]
    text = "\n".join(lines)
    return Report("generate", {"meta": meta, "rows": rows, "summary": summary}, text, command)


DEFAULTS = dict(world=2, layers=4, width=256, vocab=8192, batch=1, prompt=8, new_tokens=64, repeats=3)
QUICK = dict(layers=2, width=64, vocab=512, new_tokens=8, repeats=1)


def build_parser() -> BenchmarkParser:
    return benchmark_parser("generate", __doc__, quick=QUICK, **DEFAULTS)


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    result = report(
        args, spawn_ranks(_rank_main, args.world, args, timeout=1800), command_line("generate", argv)
    )
    result.write(args.out)
    print(result.markdown)
