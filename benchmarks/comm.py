"""Benchmark zero-comm's coalesced collectives against naive loops and plain torch collectives.

Run from the repository root::

    python -m benchmarks comm --world 2

Spawns ``--world`` local gloo ranks. For ``--tensors`` tensors of mixed odd sizes
(about ``--numel`` fp32 elements in total) it times, per variant, the median over
``--repeats`` runs of the slowest rank, and measures the bytes each rank wrote
(``wchar`` of ``/proc/self/io``) against the ring-ideal bytes:

* all-gather: ``all_gather_coalesced`` (separate shards; and shards that already lie back
  to back in one buffer, which skips the input concatenation, gathered into a
  preallocated ``out=``) vs one ``all_gather_single`` per tensor vs one
  ``all_gather_single`` of an already-flat buffer into a preallocated output (no copy-out);
* reduce-scatter: ``reduce_scatter_coalesced`` (all-to-all + local sum) vs one padded
  ``reduce_scatter_single`` per tensor vs one ``reduce_scatter_single`` of an
  already-interleaved flat buffer;
* with several simulated nodes (``--ranks-per-node``): the hierarchical all-gather too.

Writes ``comm.json`` and ``comm.md`` into ``--out`` (default ``benchmarks/results``). Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import zero_comm
from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.measure import ResultSink, spawn_ranks, time_and_count
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from zero_comm import Topology, all_gather_coalesced, partition_numel, reduce_scatter_coalesced
from zero_comm.torch_compat import all_gather_single, reduce_scatter_single


def tensor_sizes(count: int, total: int, seed: int = 0) -> list[int]:
    """``count`` odd sizes spread over two orders of magnitude, summing to about ``total``."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(count, generator=gen, dtype=torch.float64) * 4.6)
    sizes = (weights / weights.sum() * total).long().tolist()
    return [max(1, s) | 1 for s in sizes]


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, int]:
    """Median seconds (slowest rank per run) and median bytes this rank wrote, after a warm-up."""
    fn()
    slowest, wrote = time_and_count(fn, repeats)
    return statistics.median(slowest), int(statistics.median(wrote))


def gather_variants(sizes: list[int], topo: Topology) -> dict[str, tuple[Callable[[], object], int]]:
    """All-gather variants and their ring-ideal bytes per rank."""
    world = topo.world_size
    shards = [torch.randn(partition_numel(n, world)) for n in sizes]
    total = sum(s.numel() for s in shards)
    outs = [torch.empty(world * s.numel()) for s in shards]
    flat_in, flat_out = torch.cat(shards), torch.empty(world * total)
    adjacent = list(torch.split(flat_in, [s.numel() for s in shards]))  # shards kept in one buffer
    ideal = (world - 1) * total * 4

    def loop() -> None:
        for o, s in zip(outs, shards):
            all_gather_single(o, s)

    variants = {
        "all_gather_coalesced": (lambda: all_gather_coalesced(shards), ideal),
        "all_gather_coalesced, shards in one buffer, out=": (
            lambda: all_gather_coalesced(adjacent, out=flat_out),
            ideal,
        ),
        "per-tensor all_gather_single loop": (loop, ideal),
        "one all_gather_single, pre-flattened": (lambda: all_gather_single(flat_out, flat_in), ideal),
    }
    if topo.num_nodes > 1 and topo.ranks_per_node > 1:
        hops = topo.hierarchical_groups(world)
        run = lambda: zero_comm.hierarchical_all_gather_coalesced(shards, hops)
        variants["hierarchical_all_gather_coalesced"] = (run, ideal)
    return variants


def reduce_scatter_variants(sizes: list[int], world: int) -> dict[str, tuple[Callable[[], object], int]]:
    """Reduce-scatter variants and their ring-ideal bytes per rank."""
    tensors = [torch.randn(n) for n in sizes]
    parts = [partition_numel(n, world) for n in sizes]
    padded = [torch.nn.functional.pad(t, (0, world * p - t.numel())) for t, p in zip(tensors, parts)]
    outs = [torch.empty(p) for p in parts]
    flat_in, flat_out = torch.cat(padded), torch.empty(sum(parts))
    ideal = (world - 1) * sum(parts) * 4

    def loop() -> None:
        for t, p, o in zip(tensors, parts, outs):
            buf = torch.zeros(world * p)
            buf[: t.numel()] = t
            reduce_scatter_single(o, buf)

    return {
        "reduce_scatter_coalesced": (lambda: reduce_scatter_coalesced(tensors, op="sum"), ideal),
        "per-tensor reduce_scatter_single loop": (loop, ideal),
        "one reduce_scatter_single, pre-flattened": (
            lambda: reduce_scatter_single(flat_out, flat_in),
            ideal,
        ),
    }


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: ResultSink) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world)
    topo = Topology(ranks_per_node=args.ranks_per_node or args.world)
    sizes = tensor_sizes(args.tensors, args.numel)
    rows = []
    for kind, variants in (
        ("all_gather", gather_variants(sizes, topo)),
        ("reduce_scatter", reduce_scatter_variants(sizes, args.world)),
    ):
        for name, (fn, ideal) in variants.items():
            seconds, wrote = measure(fn, args.repeats)
            rows.append(
                {"op": kind, "variant": name, "seconds": seconds, "wire_bytes": wrote, "ideal_bytes": ideal}
            )
    dist.destroy_process_group()
    if rank == 0:
        results.put({"sizes": sizes, "rows": rows})


def report(args: argparse.Namespace, result: dict, command: str) -> Report:
    """``comm.json`` (everything) and ``comm.md`` (a table)."""
    env = environment("zero-comm")
    meta = {
        "date": env["date"],
        "torch": env["versions"]["torch"],
        "python": env["python"],
        "cpus": env["cpus"],
        "load_average_1m": env["load_average_1m"],
        "versions": env["versions"],
        "world": args.world,
        "ranks_per_node": args.ranks_per_node or args.world,
        "tensors": args.tensors,
        "total_numel": sum(result["sizes"]),
        "dtype": "float32",
        "repeats": args.repeats,
    }
    base = {r["op"]: r["seconds"] for r in result["rows"] if r["variant"] == f"{r['op']}_coalesced"}
    rows = []
    for r in result["rows"]:
        ratio = r["wire_bytes"] / r["ideal_bytes"] if r["ideal_bytes"] else float("nan")
        rows.append(
            [
                r["op"],
                r["variant"],
                f"{r['seconds'] * 1e3:.1f}",
                f"{r['seconds'] / base[r['op']]:.2f}",
                f"{r['wire_bytes'] / 1e6:.2f}",
                f"{ratio:.2f}",
            ]
        )
    headers = ["op", "variant", "ms", "time / coalesced", "MB written / rank", "/ ring ideal"]
    text = "\n".join(
        [
            f"# zero-comm collectives, world {meta['world']} ({meta['ranks_per_node']} per node), "
            "gloo on CPU",
            "",
            f"{meta['tensors']} fp32 tensors of mixed odd sizes, {meta['total_numel']:,} elements in total; "
            f"median of {meta['repeats']} runs (slowest rank). torch {meta['torch']}, {meta['cpus']} CPUs, "
            f"1-min load {meta['load_average_1m']:.1f} at {meta['date']}.",
            "",
            markdown_table(headers, rows, align="llrrrr"),
        ]
    )
    return Report("comm", {"meta": meta, **result}, text, command)


DEFAULTS = dict(world=2, ranks_per_node=None, tensors=64, numel=4_000_000, repeats=10)
QUICK = dict(tensors=8, numel=200_000, repeats=2)


def build_parser() -> BenchmarkParser:
    return benchmark_parser("comm", __doc__, quick=QUICK, **DEFAULTS)


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    found = spawn_ranks(_rank_main, args.world, args, timeout=600)
    result = report(args, found, command_line("comm", argv))
    result.write(args.out)
    print(result.markdown)
