"""The ``zero`` command line: ``zero estimate``, ``zero report``, ``zero train``, ``zero consolidate``.

The commands only parse arguments and format results; the work is done by
:mod:`zero_full.memory.estimate` and :mod:`zero_full.cli.doctor`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from zero_comm.units import format_bytes
from zero_full.cli.consolidate import add_consolidate_parser
from zero_full.cli.doctor import EnvironmentReport, collect_report
from zero_full.cli.train.command import add_train_parser
from zero_full.memory.estimate import (
    EstimatePrecision,
    MemoryEstimate,
    estimate_model_states,
    parse_count,
)

__all__ = ["build_parser", "main"]

PAPER_PARAMS = 7_500_000_000
PAPER_WORLD = 64

_PRECISION_TEXT = {
    EstimatePrecision.MIXED: "mixed (16-bit params 2 B + grads 2 B, fp32 Adam state K = 12 B per parameter)",
    EstimatePrecision.FP32: "fp32 (params 4 B + grads 4 B, Adam moments 8 B per parameter)",
}


def _count_arg(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``zero`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="zero",
        description="zero: ZeRO data-parallel training for PyTorch (DeepSpeed-style configs).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    est = sub.add_parser(
        "estimate",
        help="model-state memory per rank for each ZeRO stage",
        description="Model-state memory per rank (parameters, gradients, Adam state) for DDP and "
        "ZeRO stages 1-3, from the ZeRO paper's formulas. Without arguments: the paper's example, "
        "7.5B parameters on 64 ranks (120 / 31.4 / 16.6 / 1.9 GB).",
    )
    est.add_argument(
        "--params",
        type=_count_arg,
        default=PAPER_PARAMS,
        metavar="N",
        help="number of parameters, e.g. 7.5B, 125M, 350k, 1e9 (default: 7.5B)",
    )
    est.add_argument(
        "--world",
        type=_count_arg,
        default=PAPER_WORLD,
        metavar="W",
        help="data-parallel ranks (default: 64)",
    )
    est.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="only this stage (0 = DDP)")
    est.add_argument(
        "--mics-shard-size",
        type=_count_arg,
        metavar="S",
        help="also show MiCS with partition groups of S ranks (16P/S; S must divide W)",
    )
    est.add_argument(
        "--hpz",
        type=_count_arg,
        metavar="N",
        help="also show ZeRO-3 with ZeRO++ hpZ over N ranks (secondary shard: + 2P/N mixed, 4P/N fp32)",
    )
    est.add_argument(
        "--frozen-int8",
        type=_count_arg,
        metavar="F",
        help="also show ZeRO-3 with F of the parameters frozen and stored as int8 shards "
        "(zero_quantized_nontrainable_weights): 16T/N + 1.002F/N, T = P - F",
    )
    est.add_argument(
        "--precision",
        choices=[p.value for p in EstimatePrecision],
        default=EstimatePrecision.MIXED.value,
        help="mixed: 16-bit params/grads + fp32 Adam state (default); fp32: everything fp32",
    )
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.set_defaults(handler=_cmd_estimate)

    rep = sub.add_parser(
        "report",
        help="environment and backend check (versions, backends, a gloo all_reduce)",
        description="Versions, torch.distributed backends, accelerator, zero packages, and a real "
        "all_reduce over gloo between 2 local processes.",
    )
    rep.add_argument("--json", action="store_true", help="print JSON instead of text")
    rep.add_argument("--no-smoke", action="store_true", help="skip the 2-process gloo check")
    rep.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="gloo check time limit in seconds (default 30)",
    )
    rep.set_defaults(handler=_cmd_report)
    add_train_parser(sub)
    add_consolidate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zero`` command."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


# ---------------------------------------------------------------------------- estimate


def _human_count(n: int) -> str:
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Aligned plain-text table: the first ``left`` columns left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def format_estimate(est: MemoryEstimate, paper_example: bool = False) -> str:
    """The text ``zero estimate`` prints."""
    title = "Model-state memory per rank, Adam (ZeRO paper formulas)"
    if paper_example:
        title += " -- the paper's example"
    lines = [
        title,
        f"  parameters (P)  {_human_count(est.num_params)} ({est.num_params:,})",
        f"  ranks (N)       {est.world_size}",
        f"  precision       {_PRECISION_TEXT[est.precision]}",
    ]
    shard = next((s.shard_size for s in est.stages if s.shard_size is not None), None)
    hpz = next((s.hpz_size for s in est.stages if s.hpz_size is not None), None)
    frozen = next((s.frozen_int8 for s in est.stages if s.frozen_int8 is not None), None)
    lines += [f"  MiCS shard (S)  {shard} ranks"] if shard is not None else []
    lines += [f"  hpZ group (n)   {hpz} ranks"] if hpz is not None else []
    lines += [f"  int8 frozen (F) {_human_count(frozen)}, trainable T = P - F"] if frozen is not None else []
    lines += [""]
    rows = [
        [
            s.name,
            s.formula(est.precision),
            format_bytes(s.params_bytes),
            format_bytes(s.gradients_bytes),
            format_bytes(s.optimizer_bytes),
            format_bytes(s.total_bytes),
        ]
        for s in est.stages
    ]
    lines += _table(["stage", "formula", "params", "gradients", "optimizer", "total"], rows, left=2)
    lines += ["", "GB = 1e9 bytes. Activations, temporary buffers and partition padding are not included."]
    return "\n".join(lines)


def _cmd_estimate(args: argparse.Namespace) -> int:
    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    try:
        est = estimate_model_states(
            args.params, args.world, args.precision, stages, args.mics_shard_size, args.hpz, args.frozen_int8
        )
    except ValueError as err:
        print(f"zero estimate: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        paper = args.params == PAPER_PARAMS and args.world == PAPER_WORLD
        print(format_estimate(est, paper_example=paper and est.precision is EstimatePrecision.MIXED))
    return 0


# ---------------------------------------------------------------------------- report


def format_report(rep: EnvironmentReport) -> str:
    """The text ``zero report`` prints."""
    yes = {True: "yes", False: "no"}
    accel = "none (CPU only)" if rep.accelerator is None else f"{rep.accelerator} x {rep.accelerator_count}"
    rows = [
        ["python", f"{rep.python} ({rep.executable})"],
        ["platform", rep.platform],
        ["cpu cores", str(rep.cpu_count)],
        ["torch", rep.torch],
        ["torch.distributed", "available" if rep.distributed else "NOT available"],
        ["backends", ", ".join(f"{name} {yes[ok]}" for name, ok in rep.backends.items()) or "none"],
        ["accelerator", accel],
        ["cuda (torch build)", rep.cuda or "none"],
        ["triton", rep.triton or "not installed (optional: pip install zero-full[triton])"],
    ]
    rows += [[name, version or "not installed"] for name, version in rep.packages.items()]
    width = max(len(r[0]) for r in rows)
    lines = ["zero report", *(f"  {k.ljust(width)}  {v}" for k, v in rows)]
    if rep.smoke is None:
        lines.append(f"  {'gloo smoke check'.ljust(width)}  skipped")
    else:
        status = "OK" if rep.smoke.ok else "FAILED"
        lines.append(
            f"  {'gloo smoke check'.ljust(width)}  {status} in {rep.smoke.seconds:.1f} s: {rep.smoke.detail}"
        )
    for text in rep.missing:
        lines.append(f"  {'MISSING'.ljust(width)}  {text}: pip install the package")
    return "\n".join(lines)


def _cmd_report(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        print(f"zero report: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    rep = collect_report(smoke=not args.no_smoke, smoke_timeout=args.timeout)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        print(format_report(rep))
    return 0 if (rep.smoke is None or rep.smoke.ok) and not rep.missing else 1


if __name__ == "__main__":  # pragma: no cover - ``python -m zero_full.cli``
    sys.exit(main())
