"""CPU throughput of zero-kernels' torch reference: quantize / dequantize vs a plain copy.

Run from the repository root::

    python -m benchmarks quantize_kernels

For a ``--numel`` fp32 tensor (default 10M) of Gaussian data it times, per bit width (group size
``--group-size``, default 2048), the median over ``--repeats`` runs of:

* ``quantize``: fp32 -> codes + scales (new tensors, as the library returns them);
* ``dequantize``: codes + scales -> fp32, into a preallocated output;
* ``round trip``: both;

next to ``copy`` (``dst.copy_(src)`` of the same fp32 bytes into a preallocated tensor) and
``clone`` (the same with a fresh allocation). GB/s is always the fp32 tensor's bytes
(4 * numel) divided by the time, so the rows compare directly. The relative RMSE of the round
trip and the wire payload are recorded too. Writes ``quantize_kernels.json`` into ``--out``.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence

import torch

import zero_kernels
from benchmarks.kit.cli import BenchmarkParser, benchmark_parser
from benchmarks.kit.measure import median_seconds
from benchmarks.kit.report import Report, command_line, environment
from zero_kernels import QuantConfig, dequantize, quantize


def _median(fn: Callable[[], object], repeats: int) -> float:
    return median_seconds(fn, repeats, warmup=2)


def run(numel: int, group_size: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    fp32_bytes = 4 * numel
    rows: list[dict] = []

    def row(name: str, seconds: float, **extra: object) -> None:
        rows.append({"op": name, "ms": seconds * 1e3, "gb_per_s": fp32_bytes / seconds / 1e9, **extra})

    dst = torch.empty_like(x)
    row("copy (preallocated)", _median(lambda: dst.copy_(x), repeats))
    row("clone (allocating)", _median(lambda: x.clone(), repeats))
    for bits in (8, 4):
        cfg = QuantConfig(bits, group_size)
        q = quantize(x, cfg, backend="torch")
        out = torch.empty_like(x)
        rmse = ((dequantize(q, backend="torch") - x).norm() / x.norm()).item()
        t_q = _median(lambda cfg=cfg: quantize(x, cfg, backend="torch"), repeats)
        t_d = _median(lambda q=q, out=out: dequantize(q, out=out, backend="torch"), repeats)
        t_rt = _median(
            lambda cfg=cfg, out=out: dequantize(quantize(x, cfg, backend="torch"), out=out, backend="torch"),
            repeats,
        )
        extra = {"bits": bits, "payload_bytes": q.nbytes, "relative_rmse": rmse}
        row(f"int{bits} quantize", t_q, **extra)
        row(f"int{bits} dequantize", t_d, **extra)
        row(f"int{bits} round trip", t_rt, **extra)
    return {
        "benchmark": "quantize_kernels",
        "backend": "torch reference",
        "numel": numel,
        "fp32_bytes": fp32_bytes,
        "group_size": group_size,
        "repeats": repeats,
        "statistic": "median",
        "rows": rows,
        "environment": {
            "date": environment()["date"],
            "torch": torch.__version__,
            "zero_kernels": zero_kernels.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
    }


def table(result: dict) -> str:
    lines = [
        f"zero-kernels torch reference, {result['numel']:,} fp32 elements, group {result['group_size']}, "
        f"median of {result['repeats']}, {result['environment']['torch_threads']} torch threads",
        f"{'op':<22}{'ms':>9}{'GB/s':>9}{'payload MB':>12}{'rel. RMSE':>11}",
    ]
    for r in result["rows"]:
        payload = f"{r['payload_bytes'] / 1e6:.2f}" if "payload_bytes" in r else "-"
        rmse = f"{r['relative_rmse']:.4f}" if "relative_rmse" in r else "-"
        lines.append(f"{r['op']:<22}{r['ms']:>9.2f}{r['gb_per_s']:>9.2f}{payload:>12}{rmse:>11}")
    return "\n".join(lines)


def build_parser() -> BenchmarkParser:
    return benchmark_parser(
        "quantize_kernels",
        __doc__,
        quick={"numel": 1_000_000, "repeats": 3},
        numel=10_000_000,
        group_size=2048,
        repeats=15,
    )


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    result = run(args.numel, args.group_size, args.repeats)
    print(table(result))
    Report("quantize_kernels", result, command=command_line("quantize_kernels", argv)).write(args.out)
