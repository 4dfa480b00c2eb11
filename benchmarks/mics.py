"""Benchmark MiCS against ZeRO-3 at 2 simulated nodes x 2 ranks: step time and inter-node bytes.

Run from the repository root::

    python -m benchmarks mics

Spawns 4 local gloo ranks (``LOCAL_WORLD_SIZE=2``: two simulated nodes) and trains a small
GPT-2 (``transformers``; fp32 AdamW, ``gradient_accumulation_steps`` micro-steps per step)
with each configuration:

* ZeRO-3 over all 4 ranks;
* MiCS, ``mics_shard_size=2`` (one shard group per node, 2 replicas);
* MiCS, ``mics_shard_size=4`` with ``mics_hierarchical_params_gather`` (one shard group over
  both nodes, gathered in two hops).

Parameters are released after each use (``stage3_max_reuse_distance=0``, no prefetch), so every
micro-step gathers each parameter twice — the regime the formulas describe. Per optimizer step
it reports the median time of the slowest rank after ``--warmup`` steps, and the bytes each rank
sends per step by link kind from a ``zero_comm.CommLedger`` (ring-ideal wire bytes; a group
spanning nodes counts as inter-node) next to the formula (docs/mics.md):

* ZeRO-3 (the world group spans both nodes): ``3Ψ(N−1)/N`` per micro-step;
* MiCS, shard group on one node: ``2(Ψ/p)(r−1)/r`` per step (the replicate all-reduce);
* MiCS hierarchical, shard group over ``k`` nodes: per micro-step ``2(k−1)Ψ/p`` (two gathers'
  inter-node hops) plus ``Ψ(p−1)/p`` (the reduce-scatter runs over the whole shard group).

Writes ``mics.json`` and ``mics.md`` into ``--out``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.measure import ResultSink, spawn_ranks
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from benchmarks.kit.workloads import GPT2Loss, gpt2_of_width

WORLD, RANKS_PER_NODE = 4, 2
VARIANTS = {
    "ZeRO-3": {},
    "MiCS shard 2": {"mics_shard_size": 2},
    "MiCS shard 4, hierarchical": {"mics_shard_size": 4, "mics_hierarchical_params_gather": True},
}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A GPT-2 LM (random init from seed 0, no dropout) whose forward returns the loss."""
    return GPT2Loss(gpt2_of_width(args.layers, args.width, args.vocab, args.seq).build_model())


def formula_inter_bytes(name: str, psi: int, accum: int) -> float:
    """Inter-node bytes per rank per optimizer step predicted by docs/mics.md (fp32, Ψ padded)."""
    n, per_node = WORLD, RANKS_PER_NODE
    zero = VARIANTS[name]
    p = zero.get("mics_shard_size", n)
    if p == n and not zero.get("mics_hierarchical_params_gather"):
        return 4 * accum * 3 * psi * (n - 1) / n
    r, k = n // p, -(-p // per_node)
    if k == 1:
        return 4 * 2 * (psi / p) * (r - 1) / r
    return 4 * accum * (2 * (k - 1) * psi / p + psi * (p - 1) / p)


def run_variant(name: str, args: argparse.Namespace) -> dict:
    """Train ``args.warmup + args.steps`` optimizer steps; per-step times and ledger bytes."""
    import zero_full
    import zero_params
    from zero_comm import CommLedger, LinkKind, Topology, partition_numel

    rank = dist.get_rank()
    config = {
        "gradient_accumulation_steps": args.accum,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            **VARIANTS[name],
        },
    }
    engine = zero_full.initialize(build_model(args), config, lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    p = VARIANTS[name].get("mics_shard_size", WORLD)
    psi = sum(p * partition_numel(zero_params.state_of(q).numel, p) for q in engine.module.parameters())
    gen = torch.Generator().manual_seed(rank)
    times, inter, intra = [], [], []
    ledger = CommLedger(Topology())
    for step in range(args.warmup + args.steps):
        ids = [torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen) for _ in range(args.accum)]
        dist.barrier()
        ledger.records.clear()
        t0 = time.perf_counter()
        with ledger:
            for micro in ids:
                loss = engine(micro)
                engine.backward(loss)
                engine.step()
        seconds = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(seconds)
            inter.append(ledger.totals(link=LinkKind.INTER_NODE).wire_bytes)
            intra.append(ledger.totals(link=LinkKind.INTRA_NODE).wire_bytes)
    state_bytes = engine.model_state_bytes()
    engine.close()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    per_rank = torch.tensor(
        [statistics.mean(inter), statistics.mean(intra), state_bytes], dtype=torch.float64
    )
    dist.all_reduce(per_rank)
    per_rank /= WORLD
    return {
        "variant": name,
        "zero_optimization": VARIANTS[name],
        "psi_padded": psi,
        "step_seconds_median": statistics.median(slowest.tolist()),
        "inter_node_bytes_per_step": per_rank[0].item(),
        "intra_node_bytes_per_step": per_rank[1].item(),
        "inter_node_formula": formula_inter_bytes(name, psi, args.accum),
        "model_state_bytes_per_rank": per_rank[2].item(),
    }


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: ResultSink) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), LOCAL_RANK=str(rank % RANKS_PER_NODE)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    rows = [run_variant(name, args) for name in VARIANTS]
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def report(args: argparse.Namespace, rows: list[dict], command: str) -> Report:
    """``mics.json`` (everything) and ``mics.md`` (a table)."""
    meta = {
        **environment("transformers"),
        "world": WORLD,
        "ranks_per_node": RANKS_PER_NODE,
        "model": {"layers": args.layers, "width": args.width, "vocab": args.vocab, "seq": args.seq},
        "micro_batch": args.micro,
        "gradient_accumulation_steps": args.accum,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    base = rows[0]["step_seconds_median"]
    table = markdown_table(
        [
            "variant",
            "step ms",
            "time / ZeRO-3",
            "inter-node MB / step",
            "formula MB",
            "intra-node MB / step",
            "model states MB / rank",
        ],
        [
            [
                r["variant"],
                f"{r['step_seconds_median'] * 1e3:.0f}",
                f"{r['step_seconds_median'] / base:.2f}",
                f"{r['inter_node_bytes_per_step'] / 1e6:.3f}",
                f"{r['inter_node_formula'] / 1e6:.3f}",
                f"{r['intra_node_bytes_per_step'] / 1e6:.3f}",
                f"{r['model_state_bytes_per_rank'] / 1e6:.2f}",
            ]
            for r in rows
        ],
        align="lrrrrrr",
    )
    versions = meta["versions"]
    lines = [
        f"# MiCS vs ZeRO-3, {WORLD // RANKS_PER_NODE} nodes x {RANKS_PER_NODE} ranks, gloo on CPU",
        "",
        f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro}, "
        f"{args.accum} micro-steps per step, fp32 AdamW, Ψ = {rows[0]['psi_padded']:,} (padded to 4). "
        f"Median of {args.steps} steps after {args.warmup} warm-up (slowest rank); bytes per rank per "
        f"optimizer step from the CommLedger (ring-ideal). torch {versions['torch']}, transformers "
        f"{versions['transformers']}, {meta['cpus']} CPUs (4 ranks oversubscribe them), 1-min load "
        f"{meta['load_average_1m']:.1f} at {meta['date']}.",
        "",
        table,
        "",
        "The simulated nodes are processes on one machine: every link is shared memory, so step times "
        "(noisy: 4 ranks share 2 cores) reflect how many ranks each collective spans and its size, not "
        "a slow inter-node network. The inter-node bytes are what a real cluster would send across "
        "nodes; they equal the formula exactly.",
    ]
    text = "\n".join(lines)
    return Report("mics", {"meta": meta, "rows": rows}, text, command)


DEFAULTS = dict(layers=2, width=128, vocab=4096, seq=64, micro=2, accum=2, warmup=2, steps=6)
QUICK = dict(width=64, vocab=512, seq=16, warmup=1, steps=2)


def build_parser() -> BenchmarkParser:
    return benchmark_parser("mics", __doc__, quick=QUICK, **DEFAULTS)


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    result = report(args, spawn_ranks(_rank_main, WORLD, args, timeout=1800), command_line("mics", argv))
    result.write(args.out)
    print(result.markdown)
