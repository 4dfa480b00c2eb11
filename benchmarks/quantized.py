"""Benchmark ZeRO++'s quantized collectives (qwZ, qgZ) against the plain zero-comm collectives.

Run from the repository root::

    OMP_NUM_THREADS=1 python -m benchmarks quantized

Spawns 4 local gloo ranks as 2 simulated nodes x 2 ranks (``--world``, ``--ranks-per-node``).

* Gradient reduce: a ``--numel`` (10M) element fp32 gradient, 2-D so qgZ quantizes it:
  ``all_to_all_quant_reduce`` (qgZ, int4 / group 2048) vs ``reduce_scatter_coalesced`` of the
  same gradient in fp32 and in fp16.
* Parameter gather: the same number of elements sharded over the ranks:
  ``quantized_all_gather_coalesced`` (qwZ, int8 / group 2048) vs ``all_gather_coalesced`` in
  fp32 and fp16.

Per variant, after a warm-up: the median wall time of the slowest rank over ``--repeats`` calls,
and three byte counts per rank and call:

* ledger: what :class:`zero_comm.CommLedger` records (wire bytes, split intra / inter node by
  the group each collective runs on; a flat collective over the whole world counts as
  inter-node, since its group spans nodes);
* wchar: the ``wchar`` delta of ``/proc/self/io`` around the call (everything the rank wrote:
  intra- and inter-node together);
* ss: the ``bytes_sent - bytes_retrans`` deltas of every TCP socket between the ranks
  (``ss -tinp``), summed by whether the peer rank is on another simulated node: the bytes that
  really cross nodes (``None`` if ``ss`` is missing).

Then, in this process with one thread, the GB/s of zero-kernels' torch reference (quantize,
dequantize, and qgZ's swizzled quantize / fused reductions) next to a plain ``copy_`` of the same
fp32 bytes (GB/s = fp32 input bytes / time for every row).

Writes ``quantized.json`` and ``quantized.md`` into ``--out``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import zero_kernels
from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.measure import ResultSink, median_seconds, spawn_ranks, time_and_count
from benchmarks.kit.report import Report, command_line, environment, markdown_table
from zero_comm import (
    CommLedger,
    LinkKind,
    Topology,
    all_gather_coalesced,
    partition_numel,
    reduce_scatter_coalesced,
)
from zero_comm.quantized import (
    QGZ_DEFAULT_CONFIG,
    QWZ_DEFAULT_CONFIG,
    all_to_all_quant_reduce,
    quantized_all_gather_coalesced,
)
from zero_comm.torch_compat import all_gather_single
from zero_kernels import (
    QuantConfig,
    dequant_reduce,
    dequant_reduce_requant,
    dequantize,
    quantize,
    swizzled_quantize,
)

# ----------------------------------------------------------------------------- bytes on the wire


_SOCKET = re.compile(r"\S+:(\d+)\s+\S+:(\d+)\s+users:\(\(.*?pid=(\d+)")
_SENT = re.compile(r"bytes_sent:(\d+)")
_RETRANS = re.compile(r"bytes_retrans:(\d+)")


def socket_bytes_sent(pids: set[int]) -> dict[tuple[int, int], int] | None:
    """``{(pid, peer pid): bytes}`` sent over the TCP sockets of ``pids`` with each other (``ss``).

    Counts ``bytes_sent - bytes_retrans``: on a loaded machine loopback TCP retransmits whole
    segments (tail-loss probes) that the application wrote once.
    """
    try:
        text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    sockets = []  # (local port, peer port, pid, bytes sent once)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _SOCKET.search(line)
        if m and int(m.group(3)) in pids:
            info = lines[i + 1] if i + 1 < len(lines) else ""
            sent, retrans = _SENT.search(info), _RETRANS.search(info)
            unique = (int(sent.group(1)) if sent else 0) - (int(retrans.group(1)) if retrans else 0)
            sockets.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), unique))
    owner = {local: pid for local, _, pid, _ in sockets}
    sent_to: dict[tuple[int, int], int] = {}
    for _, peer, pid, sent in sockets:
        if peer in owner and owner[peer] != pid:
            key = (pid, owner[peer])
            sent_to[key] = sent_to.get(key, 0) + sent
    return sent_to


def cross_node_bytes(
    before: dict[tuple[int, int], int] | None,
    after: dict[tuple[int, int], int] | None,
    node_of_pid: dict[int, int],
) -> tuple[int, int] | None:
    """Total (intra-node, cross-node) bytes sent between two ``socket_bytes_sent`` snapshots."""
    if before is None or after is None:
        return None
    intra = cross = 0
    for key, sent in after.items():
        delta = sent - before.get(key, 0)
        if node_of_pid[key[0]] == node_of_pid[key[1]]:
            intra += delta
        else:
            cross += delta
    return intra, cross


# ----------------------------------------------------------------------------- one variant


def measure(
    fn: Callable[[], object], repeats: int, topo: Topology, pids: list[int], ss_repeats: int
) -> dict[str, object]:
    """Time, ledger bytes, wchar and (on rank 0) per-link socket bytes of one call of ``fn``."""
    fn()  # warm-up: creates the groups and connections
    with CommLedger(topo) as ledger:
        fn()
    inter = ledger.totals(link=LinkKind.INTER_NODE)
    intra = ledger.totals(link=LinkKind.INTRA_NODE)
    slowest, wrote = time_and_count(fn, repeats)
    wchar = torch.tensor([statistics.median(wrote)], dtype=torch.float64)
    dist.all_reduce(wchar)
    node_of_pid = {pid: r // topo.ranks_per_node for r, pid in enumerate(pids)}
    links = []
    for _ in range(ss_repeats):  # rank 0 reads every rank's sockets while all others wait
        dist.barrier()
        before = socket_bytes_sent(set(pids)) if topo.rank == 0 else None
        dist.barrier()
        fn()
        dist.barrier()
        after = socket_bytes_sent(set(pids)) if topo.rank == 0 else None
        dist.barrier()  # nobody starts sending again before rank 0 has read the sockets
        links.append(cross_node_bytes(before, after, node_of_pid))
    ss = None
    if topo.rank == 0 and links and all(link is not None for link in links):
        per_rank = topo.world_size
        ss = {
            "intra_node_bytes": statistics.median(link[0] for link in links) / per_rank,
            "cross_node_bytes": statistics.median(link[1] for link in links) / per_rank,
        }
    return {
        "ms": statistics.median(slowest) * 1e3,
        "ledger_inter_wire_bytes": inter.wire_bytes,
        "ledger_intra_wire_bytes": intra.wire_bytes,
        "ledger_calls": inter.calls + intra.calls,
        "wchar_bytes": wchar.item() / topo.world_size,
        "ss": ss,
    }


def relative_rmse(got: torch.Tensor, exact: torch.Tensor) -> float:
    """World-wide ||got - exact|| / ||exact||."""
    sums = torch.tensor(
        [((got.double() - exact.double()) ** 2).sum().item(), (exact.double() ** 2).sum().item()],
        dtype=torch.float64,
    )
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: ResultSink) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world)
    topo = Topology(ranks_per_node=args.ranks_per_node)
    pid = torch.tensor([os.getpid()])
    pids = torch.zeros(args.world, dtype=torch.long)
    all_gather_single(pids, pid)
    pid_list = pids.tolist()
    gen = torch.Generator().manual_seed(rank)
    world = args.world
    grad = torch.randn(args.numel // 1000, 1000, generator=gen)
    grad16 = grad.half()
    shard = torch.randn(partition_numel(args.numel, world), generator=gen)
    shard16 = shard.half()
    qgz, qwz = QGZ_DEFAULT_CONFIG, QWZ_DEFAULT_CONFIG
    variants = {
        ("reduce", "reduce_scatter_coalesced fp32"): lambda: reduce_scatter_coalesced([grad]),
        ("reduce", "reduce_scatter_coalesced fp16"): lambda: reduce_scatter_coalesced([grad16]),
        ("reduce", "qgZ all_to_all_quant_reduce int4 (fp32 in/out)"): lambda: all_to_all_quant_reduce(
            [grad], topo, config=qgz
        ),
        ("gather", "all_gather_coalesced fp32"): lambda: all_gather_coalesced([shard]),
        ("gather", "all_gather_coalesced fp16"): lambda: all_gather_coalesced([shard16]),
        ("gather", "qwZ quantized_all_gather_coalesced int8 (fp32 in/out)"): lambda: (
            quantized_all_gather_coalesced([shard], config=qwz)
        ),
    }
    rows = []
    for (kind, name), fn in variants.items():
        row = {"op": kind, "variant": name, **measure(fn, args.repeats, topo, pid_list, args.ss_repeats)}
        rows.append(row)
    (exact,) = reduce_scatter_coalesced([grad])
    (approx,) = all_to_all_quant_reduce([grad], topo, config=qgz)
    (full,) = all_gather_coalesced([shard])
    (qfull,) = quantized_all_gather_coalesced([shard], config=qwz)
    errors = {
        "qgZ relative RMSE": relative_rmse(approx, exact),
        "qwZ relative RMSE": relative_rmse(qfull, full),
    }
    dist.destroy_process_group()
    if rank == 0:
        results.put({"rows": rows, "errors": errors})


# ----------------------------------------------------------------------------- kernel throughput


def kernel_throughput(numel: int, world: int, rpn: int, repeats: int) -> list[dict]:
    """GB/s (fp32 input bytes / time) of the torch reference vs a copy, one thread, this process."""
    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)
    nodes = world // rpn
    fp32_bytes = 4 * numel
    ops: dict[str, Callable[[], object]] = {"copy_ (same fp32 bytes)": lambda: dst.copy_(x)}
    for bits in (8, 4):
        cfg = QuantConfig(bits, 2048)
        q = quantize(x, cfg, backend="torch")
        ops[f"int{bits} quantize"] = lambda cfg=cfg: quantize(x, cfg, backend="torch")
        ops[f"int{bits} dequantize"] = lambda q=q: dequantize(q, out=dst, backend="torch")
    q4 = swizzled_quantize(x, QGZ_DEFAULT_CONFIG, nodes, rpn, backend="torch")
    ops["int4 swizzled_quantize"] = lambda: swizzled_quantize(
        x, QGZ_DEFAULT_CONFIG, nodes, rpn, backend="torch"
    )
    ops[f"int4 dequant_reduce_requant ({rpn} sources)"] = lambda: dequant_reduce_requant(
        q4, rpn, QGZ_DEFAULT_CONFIG, backend="torch"
    )
    ops[f"int4 dequant_reduce ({nodes} sources)"] = lambda: dequant_reduce(q4, nodes, backend="torch")
    rows = []
    for name, fn in ops.items():
        seconds = median_seconds(fn, repeats, warmup=1)
        rows.append({"op": name, "ms": seconds * 1e3, "gb_per_s": fp32_bytes / seconds / 1e9})
    return rows


# ----------------------------------------------------------------------------- report


def ratios(rows: list[dict]) -> dict[str, float | None]:
    by = {r["variant"]: r for r in rows}
    qgz = by["qgZ all_to_all_quant_reduce int4 (fp32 in/out)"]
    qwz = by["qwZ quantized_all_gather_coalesced int8 (fp32 in/out)"]
    out: dict[str, float | None] = {}
    for base in ("fp32", "fp16"):
        rs, ag = by[f"reduce_scatter_coalesced {base}"], by[f"all_gather_coalesced {base}"]
        out[f"qgZ / reduce_scatter {base}: inter-node, ledger"] = (
            qgz["ledger_inter_wire_bytes"] / rs["ledger_inter_wire_bytes"]
        )
        total = lambda r: r["ledger_inter_wire_bytes"] + r["ledger_intra_wire_bytes"]
        out[f"qgZ / reduce_scatter {base}: all bytes, ledger"] = total(qgz) / total(rs)
        out[f"qgZ / reduce_scatter {base}: all bytes, wchar"] = qgz["wchar_bytes"] / rs["wchar_bytes"]
        out[f"qgZ / reduce_scatter {base}: cross-node, ss"] = (
            qgz["ss"]["cross_node_bytes"] / rs["ss"]["cross_node_bytes"] if qgz["ss"] and rs["ss"] else None
        )
        out[f"qwZ / all_gather {base}: ledger"] = (
            qwz["ledger_inter_wire_bytes"] / ag["ledger_inter_wire_bytes"]
        )
        out[f"qwZ / all_gather {base}: wchar"] = qwz["wchar_bytes"] / ag["wchar_bytes"]
        out[f"qwZ / all_gather {base}: cross-node, ss"] = (
            qwz["ss"]["cross_node_bytes"] / ag["ss"]["cross_node_bytes"] if qwz["ss"] and ag["ss"] else None
        )
    return out


def markdown(result: dict) -> str:
    meta = result["meta"]
    mb = lambda n: f"{n / 1e6:.2f}" if n is not None else "-"
    lines = [
        f"# ZeRO++ quantized collectives, {meta['nodes']} nodes x {meta['ranks_per_node']} ranks, "
        "gloo on CPU",
        "",
        f"{meta['numel']:,}-element gradient / parameter; qgZ int{meta['qgz_bits']} group "
        f"{meta['qgz_group']}, "
        f"qwZ int{meta['qwz_bits']} group {meta['qwz_group']}. Median of {meta['repeats']} calls (slowest "
        f"rank); bytes per rank and call. torch {meta['torch']}, {meta['cpus']} CPUs shared by "
        f"{meta['world']} ranks (1 thread each), 1-min load {meta['load_average_1m']:.1f} at {meta['date']}.",
        "",
        "Ledger: wire bytes by the group's link kind (a flat collective over the world counts as "
        "inter-node). wchar: all bytes the rank wrote. ss: TCP bytes really sent to ranks on the same / "
        "another node.",
        "",
    ]
    rows = []
    for r in result["rows"]:
        ss = r["ss"] or {}
        rows.append(
            [
                r["op"],
                r["variant"],
                f"{r['ms']:.0f}",
                mb(r["ledger_inter_wire_bytes"]),
                mb(r["ledger_intra_wire_bytes"]),
                mb(r["wchar_bytes"]),
                mb(ss.get("intra_node_bytes")),
                mb(ss.get("cross_node_bytes")),
            ]
        )
    headers = ["op", "variant", "ms", "ledger inter MB", "ledger intra MB", "wchar MB"]
    lines.append(markdown_table([*headers, "ss intra MB", "ss cross-node MB"], rows, align="llrrrrrr"))
    ratio_rows = [[n, "-" if v is None else f"{v:.3f}"] for n, v in result["ratios"].items()]
    error_rows = [[n.replace(" relative RMSE", ""), f"{v:.4f}"] for n, v in result["errors"].items()]
    kernel_rows = [[r["op"], f"{r['ms']:.1f}", f"{r['gb_per_s']:.2f}"] for r in result["kernels"]]
    lines += [
        "",
        markdown_table(["ratio", "value"], ratio_rows, align="lr"),
        "",
        markdown_table(["error vs the exact collective", "relative RMSE"], error_rows, align="lr"),
        "",
        f"Kernel throughput, torch reference on CPU, {meta['numel']:,} fp32 elements, one thread "
        "(GB/s = fp32 input bytes / time):",
        "",
        markdown_table(["op", "ms", "GB/s"], kernel_rows, align="lrr"),
    ]
    return "\n".join(lines) + "\n"


DEFAULTS = dict(world=4, ranks_per_node=2, numel=10_000_000, repeats=5, ss_repeats=3, kernel_repeats=7)
QUICK = dict(numel=400_000, repeats=2, ss_repeats=1, kernel_repeats=2)


def build_parser() -> BenchmarkParser:
    return benchmark_parser("quantized", __doc__, quick=QUICK, **DEFAULTS)


def main(argv: Sequence[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world % args.ranks_per_node or args.numel % (1000 * args.world):
        parser.error("--ranks-per-node must divide --world, and --numel must be a multiple of 1000 * --world")
    kernels = kernel_throughput(args.numel, args.world, args.ranks_per_node, args.kernel_repeats)
    dist_result = spawn_ranks(_rank_main, args.world, args, timeout=3600)
    env = environment("zero-comm", "zero-kernels")
    meta = {
        "date": env["date"],
        "torch": env["versions"]["torch"],
        "zero_kernels": zero_kernels.__version__,
        "python": env["python"],
        "cpus": env["cpus"],
        "load_average_1m": env["load_average_1m"],
        "versions": env["versions"],
        "world": args.world,
        "nodes": args.world // args.ranks_per_node,
        "ranks_per_node": args.ranks_per_node,
        "numel": args.numel,
        "repeats": args.repeats,
        "qgz_bits": QGZ_DEFAULT_CONFIG.bits,
        "qgz_group": QGZ_DEFAULT_CONFIG.group_size,
        "qwz_bits": QWZ_DEFAULT_CONFIG.bits,
        "qwz_group": QWZ_DEFAULT_CONFIG.group_size,
    }
    result = {"meta": meta, **dist_result, "ratios": ratios(dist_result["rows"]), "kernels": kernels}
    text = markdown(result)
    Report("quantized", result, text, command_line("quantized", argv)).write(args.out)
    print(text)
