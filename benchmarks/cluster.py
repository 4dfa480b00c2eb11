"""Step time and inter-node bytes at 2 simulated nodes x 2 ranks over a shaped link.

Run from the repository root, as root (``nox -s cluster-bench`` does)::

    python -m benchmarks cluster --rate-mbit 20 --docs docs

Builds a :class:`zero_testing.netns.SimulatedCluster` (one network namespace per node, veth
links through a bridge, each link shaped with ``tc tbf`` at ``--rate-mbit`` in both
directions; loopback inside a node) and trains a small GPT-2 (``transformers``, bf16 working
precision, AdamW) with each variant, every one in fresh rank processes:

* DDP (torch ``DistributedDataParallel`` on the bf16 model);
* ZeRO-3 (parameters released after each use: persistence threshold 0, reuse distance 0, no
  prefetch, a small live bound);
* MiCS with one shard group per node (``mics_shard_size = 2``);
* ZeRO++: qwZ, hpZ, qgZ alone and all three. A variant the installed ``zero_full`` does not
  implement (its config lists it in ``unsupported_features()``) is reported as "not
  available in this build" and not run.

Per optimizer step it reports the median step time of the slowest rank and three figures of
inter-node traffic: the ``CommLedger``'s wire bytes per rank on node-spanning groups (the
ZeRO / ZeRO++ papers' per-rank volume, ``3M(N-1)/N`` for ZeRO-3), the bytes each node sends to
the other from the rank-pair model of :mod:`zero_testing.traffic` (independent of the ledger's
classification) and the same from the veth counters (physical, headers included).

Writes ``cluster.json``, ``cluster.md`` and ``cluster.png`` into ``--out``; ``--docs DIR`` also
puts the plot and the table into ``DIR/benchmarks.md``'s ``cluster`` block. Not a test: the
only check is that the rank-pair model and the veth counters agree (printed).
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.docs import DocsBlock
from benchmarks.kit.report import Report, command_line, environment, markdown_table, pyplot, save_figure
from benchmarks.kit.workloads import GPT2Loss, gpt2_of_width

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
RELEASE = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_live_parameters": 100_000,
}
GATHER_OPS = ("all_gather", "quantized_all_gather")
BLOCK = DocsBlock("benchmarks.md", "cluster")
VARIANTS: dict[str, dict[str, Any] | None] = {
    "DDP": None,
    "ZeRO-3": {},
    "MiCS shard = node": {"mics_shard_size": RANKS_PER_NODE},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": RANKS_PER_NODE},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ + hpZ + qgZ": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": RANKS_PER_NODE,
        "zero_quantized_gradients": True,
    },
}


def zero_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The zero_full config of a ZeRO variant: bf16, released parameters, plus ``extra``."""
    return {"bf16": {"enabled": True}, "zero_optimization": {**RELEASE, **extra}}


def unavailable(name: str) -> str | None:
    """Why ``name`` cannot run with the installed zero_full (``None``: it can)."""
    extra = VARIANTS[name]
    if extra is None:
        return None
    import zero_full

    try:
        cfg = zero_full.ZeroConfig.model_validate(zero_config(extra))
    except ValueError as exc:
        return f"not available in this build (config refused: {str(exc).splitlines()[0]})"
    missing = getattr(cfg, "unsupported_features", list)()
    if missing:
        return f"not available in this build ({'; '.join(missing)})"
    return None


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A GPT-2 LM (random init from seed 0, no dropout) whose forward returns the loss."""
    return GPT2Loss(gpt2_of_width(args.layers, args.width, args.vocab, args.seq).build_model())


def _make_step(name: str, args: argparse.Namespace):
    """``(step(ids, after_forward) -> loss, close(), numel)`` for variant ``name`` on this rank."""
    model = build_model(args)
    numel = sum(p.numel() for p in model.parameters())
    extra = VARIANTS[name]
    if extra is None:
        ddp = torch.nn.parallel.DistributedDataParallel(model.to(torch.bfloat16))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

        def step(ids: torch.Tensor, after_forward: Callable[[], object]) -> float:
            loss = ddp(ids)
            after_forward()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return step, lambda: None, numel
    import zero_full

    # Ranks start at different times on a loaded machine: meet first, so the watchdog of
    # initialize's first collective does not take a late rank for a dead one.
    dist.barrier()
    engine = zero_full.initialize(model, zero_config(extra), lambda ps: torch.optim.AdamW(ps, lr=1e-4))

    def zstep(ids: torch.Tensor, after_forward: Callable[[], object]) -> float:
        loss = engine(ids)
        after_forward()
        engine.backward(loss)
        engine.step()
        return loss.item()

    return zstep, engine.close, numel


def _rank_variant(info: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of variant ``name``; this rank's times, records and veth bytes."""
    from zero_comm import CommLedger, LinkKind, Topology
    from zero_testing.netns import interface_counters

    step, close, numel = _make_step(name, args)
    gen = torch.Generator().manual_seed(info.rank)
    ledger = CommLedger(Topology())
    times: list[float] = []
    veth: list[tuple[int, int]] = []
    ledger_inter: list[int] = []
    backward_gathers: list[int] = []
    records: list[tuple] = []
    losses: list[float] = []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen)
        dist.barrier()
        ledger.records.clear()
        tx0 = interface_counters()
        dist.barrier()  # every rank has read the counters before any rank sends
        t0 = time.perf_counter()
        with ledger:
            losses.append(step(ids, ledger.step))
        seconds = time.perf_counter() - t0
        dist.barrier()
        sent = interface_counters() - tx0
        if i >= args.warmup:
            times.append(seconds)
            veth.append((sent.tx_bytes, sent.payload_bytes))
            ledger_inter.append(ledger.totals(link=LinkKind.INTER_NODE).wire_bytes)
            backward = ledger.select(link=LinkKind.INTER_NODE, step=ledger.current_step)
            backward_gathers.append(sum(r.wire_bytes for r in backward if r.op in GATHER_OPS))
            if i == args.warmup:
                records = [(r.op, r.group_ranks, r.payload_bytes, r.wire_bytes) for r in ledger.records]
    close()
    return {
        "times": times,
        "veth_tx": veth,
        "ledger_inter": ledger_inter,
        "ledger_backward_gathers": backward_gathers,
        "records": records,
        "numel": numel,
        "losses": losses,
    }


def ddp_node_egress(model_bytes: float) -> float:
    """Bytes a node sends to the other per DDP step: one ring all-reduce of the gradients."""
    return 2 * (WORLD - 1) / WORLD * model_bytes


def _link_rate(info: Any, nbytes: int) -> float:
    """Rank 0 (node 0) sends ``nbytes`` to rank 1 (node 1) after a warm-up; Mbit/s seen by rank 1."""
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(2):  # warm-up (connection, TCP window), then the timed transfer
        dist.barrier()
        t0 = time.perf_counter()
        if info.rank == 0:
            dist.send(payload, 1)
        else:
            dist.recv(payload, 0)
        seconds = time.perf_counter() - t0
    return nbytes * 8 / seconds / 1e6


def measure_link(cluster: Any, nbytes: int = 4_000_000) -> float:
    """The inter-node rate one gloo send achieves on ``cluster``'s link, Mbit/s (checks the shaping)."""
    from zero_testing.netns import run_on_cluster

    return run_on_cluster(cluster, NODES, _link_rate, nbytes, ranks_per_node=1, timeout=600)[1]


def run_variant(name: str, args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    """One variant in fresh ranks on ``cluster``; the row of the table."""
    from zero_testing.netns import run_on_cluster
    from zero_testing.traffic import node_egress_bytes

    why = unavailable(name)
    if why is not None:
        return {"variant": name, "status": why}
    ranks = run_on_cluster(
        cluster, WORLD, _rank_variant, name, args, ranks_per_node=RANKS_PER_NODE, timeout=1800
    )
    model_bytes = 2 * ranks[0]["numel"]  # M: bf16 working precision
    slowest = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
    veth = [statistics.median(p for _, p in ranks[n * RANKS_PER_NODE]["veth_tx"]) for n in range(NODES)]
    veth_raw = [statistics.median(b for b, _ in ranks[n * RANKS_PER_NODE]["veth_tx"]) for n in range(NODES)]
    if VARIANTS[name] is None:
        model = [ddp_node_egress(model_bytes)] * NODES
        ledger = backward = None
    else:
        model = node_egress_bytes([r["records"] for r in ranks], RANKS_PER_NODE)
        ledger = statistics.mean(statistics.mean(r["ledger_inter"]) for r in ranks)
        backward = statistics.mean(statistics.mean(r["ledger_backward_gathers"]) for r in ranks)
    return {
        "variant": name,
        "status": "ran",
        "zero_optimization": VARIANTS[name],
        "model_bytes_M": model_bytes,
        "step_seconds_median": statistics.median(slowest),
        "step_seconds_all": slowest,
        "ledger_inter_bytes_per_rank": ledger,
        "ledger_backward_gather_inter_bytes_per_rank": backward,
        "pair_model_node_egress_bytes": model,
        "veth_node_egress_bytes": veth,
        "veth_node_egress_bytes_with_headers": veth_raw,
        "losses_rank0": ranks[0]["losses"],
    }


def report(args: argparse.Namespace, rows: list[dict], link: dict, command: str) -> Report:
    """``cluster.json``, ``cluster.md`` and ``cluster.png``; the table for the docs block."""
    meta = {
        **environment("transformers", "zero-full"),
        "command": command,
        "nodes": NODES,
        "ranks_per_node": RANKS_PER_NODE,
        "link": link,
        "model": {"layers": args.layers, "width": args.width, "vocab": args.vocab, "seq": args.seq},
        "micro_batch": args.micro,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    ran = [r for r in rows if r["status"] == "ran"]
    base = next((r["step_seconds_median"] for r in ran if r["variant"] == "ZeRO-3"), None)
    m = ran[0]["model_bytes_M"] if ran else 0
    table_rows = []
    for r in rows:
        if r["status"] != "ran":
            table_rows.append([r["variant"], r["status"], "", "", "", "", "", ""])
            continue
        ledger = r["ledger_inter_bytes_per_rank"]
        model, veth = (
            statistics.mean(r["pair_model_node_egress_bytes"]),
            statistics.mean(r["veth_node_egress_bytes"]),
        )
        table_rows.append(
            [
                r["variant"],
                f"{r['step_seconds_median'] * 1e3:.0f}",
                f"{base / r['step_seconds_median']:.2f}" if base else "",
                "torch DDP (no ledger)" if ledger is None else f"{ledger / m:.3f}",
                "" if ledger is None else f"{r['ledger_backward_gather_inter_bytes_per_rank'] / m:.3f}",
                f"{model / m:.3f}",
                f"{veth / m:.3f}",
                f"{veth / model - 1:+.1%}",
            ]
        )
    table = markdown_table(
        [
            "variant",
            "step ms",
            "speed-up vs ZeRO-3",
            "ledger inter-node / rank (xM)",
            "of which backward gathers (xM)",
            "pair model: node egress (xM)",
            "veth: node egress payload (xM)",
            "veth vs model",
        ],
        table_rows,
        align="lrrrrrrr",
    )
    v = meta["versions"]
    lines = [
        f"# Simulated cluster: {NODES} nodes x {RANKS_PER_NODE} ranks over a {link['description']}",
        "",
        f"Command: `{meta['command']}` (as root). {_link_line(link)}",
        "",
        f"{meta['cpus']} CPUs shared by the {WORLD} ranks and "
        f"other work (1-min load {meta['load_average_1m']:.1f} at {meta['date']}): step times are from a "
        f"loaded machine, compare them only within this table. torch {v['torch']}, transformers "
        f"{v['transformers']}, zero-full {v['zero-full']}.",
        "",
        f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro} "
        f"per rank, bf16 working precision, AdamW; M = {m / 1e6:.3f} MB (model bytes in bf16). Median "
        f"of {args.steps} steps after {args.warmup} warm-up (slowest rank).",
        "",
        table,
        "",
        "Columns: the ledger's wire bytes per rank on node-spanning groups (ring-ideal; the ZeRO++ "
        "paper's per-rank cross-node volume: 3M(N-1)/N for ZeRO-3, 0.75M for all three ZeRO++ "
        "parts at large N), and the part of it in backward's all-gathers (0 with hpZ); the bytes "
        "each node sends to the other by the rank-pair model of "
        "`zero_testing.traffic` (gloo's rings and all-to-alls, per pair); the same from the veth "
        "counters, less 66 bytes of TCP/IP headers per frame (the barriers around each step and "
        "collectives outside the ledger, e.g. the loss scaler's flag, included). The JSON also has the "
        "veth bytes with headers.",
    ]
    return Report("cluster", {"meta": meta, "rows": rows}, "\n".join(lines), plot=plot, block=BLOCK)


def _link_line(link: dict) -> str:
    measured = link.get("measured_mbit")
    if measured is None:
        return ""
    return f"One 4 MB gloo send between the nodes ran at {measured:.1f} Mbit/s (the shaping at work)."


def plot(result: dict[str, Any], out: pathlib.Path, stem: str) -> list[pathlib.Path]:
    """Two panels: step time and inter-node payload per node (veth) of each variant that ran."""
    plt = pyplot()

    rows = [r for r in result["rows"] if r["status"] == "ran"]
    m = rows[0]["model_bytes_M"] if rows else 1
    names = [r["variant"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.barh(names, [r["step_seconds_median"] * 1e3 for r in rows], color="tab:blue")
    left.set_xlabel("step time, ms (loaded machine)")
    left.invert_yaxis()
    right.barh(names, [statistics.mean(r["veth_node_egress_bytes"]) / m for r in rows], color="tab:orange")
    right.set_xlabel("bytes a node sends to the other per step (veth), x M")
    right.invert_yaxis()
    right.set_yticklabels([])
    return [save_figure(fig, out / f"{stem}.png")]


DEFAULTS = dict(burst_kib=64, layers=2, width=256, vocab=4096, seq=32, micro=1, warmup=2, steps=5)
QUICK = dict(width=64, vocab=512, warmup=1, steps=2)


def build_parser() -> BenchmarkParser:
    parser = benchmark_parser("cluster", __doc__, quick=QUICK, docs=True, **DEFAULTS)
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="inter-node link rate; 0: unshaped")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    return parser


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    from zero_testing.netns import LinkShape, SimulatedCluster, cluster_unavailable_reason

    why = cluster_unavailable_reason()
    if why is not None:
        raise SystemExit(f"cluster benchmark: {why}")
    # SIGTERM unwinds like Ctrl-C, so the cluster's namespaces are removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shape = LinkShape(args.rate_mbit or None, burst_kib=args.burst_kib)
    link = {
        "rate_mbit": shape.rate_mbit,
        "burst_kib": shape.burst_kib,
        "delay": "none (netem is not available on this kernel)",
        "description": f"{args.rate_mbit:g} Mbit/s link (tc tbf, no delay)"
        if shape.rate_mbit
        else "unshaped veth",
    }
    rows = []
    with SimulatedCluster(NODES, shape) as cluster:
        link["measured_mbit"] = measure_link(cluster)
        print(f"link: one gloo send node 0 -> node 1 at {link['measured_mbit']:.1f} Mbit/s", flush=True)
        for name in args.variants:
            row = run_variant(name, args, cluster)
            rows.append(row)
            print(name, {k: row[k] for k in row if k in ("status", "step_seconds_median")}, flush=True)
    result = report(args, rows, link, command_line("cluster", argv))
    result.write(args.out, args.docs)
    print(result.markdown)
