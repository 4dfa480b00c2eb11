"""The closing table of ``zero train``: memory per rank against DDP and the formula, traffic, loss.

:class:`TrainSummary` is what :func:`zero_full.cli.train.run.run_training` returns; :func:`format_summary`
the table the command prints.
"""

from __future__ import annotations

import dataclasses
import math

from zero_comm.units import format_bytes
from zero_full.cli.train.options import TrainOptions
from zero_full.cli.train.rank import RankResult
from zero_full.config.zero_config import Precision, ZeroConfig
from zero_full.memory.estimate import EstimatePrecision, estimate_model_states

__all__ = ["TrainSummary", "format_summary"]


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    """The outcome of :func:`run_training`: the options, the config used and every rank's result.

    ``seconds`` is the whole run's wall time; ``startup_seconds`` the part before every rank
    was ready to train (processes spawned, model built, engine initialized).
    """

    options: TrainOptions
    config: ZeroConfig
    ranks_per_node: int
    results: tuple[RankResult, ...]
    seconds: float
    startup_seconds: float = 0.0

    @property
    def losses(self) -> tuple[float, ...]:
        """Per-step loss averaged over the ranks."""
        return self.results[0].losses

    @property
    def loss_went_down(self) -> bool:
        """The final loss is finite and below the first step's."""
        return math.isfinite(self.losses[-1]) and self.losses[-1] < self.losses[0]


def _memory_rows(summary: TrainSummary) -> list[tuple[str, str]]:
    psi, world, stage = summary.results[0].num_params, summary.options.world, summary.config.stage
    precision = (
        EstimatePrecision.FP32 if summary.config.precision is Precision.FP32 else EstimatePrecision.MIXED
    )
    est = {s.stage: s.total_bytes for s in estimate_model_states(psi, world, precision, (0, stage)).stages}
    rows = [
        (f"model states, rank {r.rank} (measured)", format_bytes(r.model_state_bytes))
        for r in summary.results
    ]
    worst = max(r.model_state_bytes for r in summary.results)
    rows += [_rss_row(r) for r in summary.results]
    rows += [
        ("DDP would hold (16P, fp32 AdamW)", format_bytes(16 * psi)),
        (f"ZeRO-{stage} formula ({precision.formula(stage)})", format_bytes(est[stage])),
        ("saving vs DDP (largest rank)", f"{16 * psi / worst:.2f}x less"),
    ]
    return rows


def _rss_row(r: RankResult) -> tuple[str, str]:
    """Real memory of one rank: RSS at rest and the step's peak, above the runtime's own."""
    rest, peak = r.rest_rss_bytes - r.runtime_rss_bytes, r.step_peak_rss_bytes - r.runtime_rss_bytes
    since = "" if r.peak_resettable else " (peak since start: no /proc)"
    runtime = format_bytes(r.runtime_rss_bytes)
    return (
        f"RSS at rest / step peak, rank {r.rank}",
        f"{format_bytes(rest)} / {format_bytes(peak)} above the runtime's {runtime}{since}",
    )


def _comm_rows(summary: TrainSummary) -> list[tuple[str, str]]:
    r0, steps, world = summary.results[0], summary.options.steps, summary.options.world
    ddp = 2 * (world - 1) / world * 4 * r0.num_params  # ring all-reduce of fp32 gradients
    rows = [
        (
            "communicated per step (rank 0)",
            f"{format_bytes(r0.comm.wire_bytes / steps)} sent (ring-ideal), "
            f"{format_bytes(r0.comm.payload_bytes / steps)} payload, {r0.comm.calls / steps:.0f} collectives",
        ),
        ("DDP all-reduce would send (2(N-1)/N x 4P)", format_bytes(ddp)),
    ]
    if summary.config.stage == 3:
        peak = max(r.peak_live_elements for r in summary.results)
        params = r0.params
        hit = f"{params.prefetch_hit_rate:.1%} ({params.prefetch_hits} hits, {params.prefetch_misses} misses"
        hit += f", steps 2-{steps})" if steps > 1 else ", no step after the first)"
        rows += [
            ("peak live parameters", f"{peak:,} elements ({peak / r0.num_params:.1%} of P)"),
            ("prefetch hit rate", hit),
        ]
    else:
        rows += [("peak live parameters", f"{r0.num_params:,} (stage {summary.config.stage}: whole model)")]
    return rows


def format_summary(summary: TrainSummary) -> str:
    """The closing table ``zero train`` prints."""
    opts, r0 = summary.options, summary.results[0]
    losses = summary.losses
    tokens = sum(r.tokens for r in summary.results)
    loop = r0.seconds  # rank 0's clock, like the progress bar's figure
    nodes = opts.world // summary.ranks_per_node
    head = (
        f"zero train: ZeRO stage {summary.config.stage}, {opts.world} ranks ({nodes} node(s) x "
        f"{summary.ranks_per_node}), GPT-2 {opts.layers} layers x {opts.hidden} hidden, {opts.heads} heads, "
        f"vocab {opts.vocab}, seq {opts.seq}, P = {r0.num_params:,} parameters, "
        f"{summary.config.precision.value}"
    )
    rows = [*_memory_rows(summary), *_comm_rows(summary)]
    rows += [
        ("loss (first -> final step)", f"{losses[0]:.4f} -> {losses[-1]:.4f}"),
        ("loss went down", "yes" if summary.loss_went_down else "NO"),
        ("start-up (processes, model, initialize)", f"{summary.startup_seconds:.1f} s"),
        ("throughput", f"{tokens / loop:,.0f} tokens/s ({opts.steps} steps in {loop:.1f} s)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [head, "", f"  {'metric'.ljust(width)}  value", f"  {'-' * width}  {'-' * 5}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [
        "",
        "MB = 1e6 bytes. Model states: parameters + gradients + optimizer state, padding included.",
        "RSS: the process's resident memory above the runtime (torch, gloo, imports: the RSS before the",
        "model); at rest after the last step, step peak with the peak reset before each step",
        "(MALLOC_MMAP_THRESHOLD_=1048576 unless set: freed blocks >= 1 MiB leave the RSS).",
    ]
    return "\n".join(lines)
