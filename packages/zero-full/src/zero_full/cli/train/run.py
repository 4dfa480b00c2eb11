"""``zero train``'s launch: the ranks, their progress bar, their failures."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
from typing import Any

from zero_full.cli.train.options import TrainOptions, build_config
from zero_full.cli.train.rank import train_rank
from zero_full.cli.train.summary import TrainSummary
from zero_full.cli.train.workloads import require_transformers
from zero_full.config.zero_config import ZeroConfig
from zero_launch import LaunchError, RankFailure, RankFailureKind, launch

__all__ = ["TrainError", "run_training"]

_SILENCE_MARGIN_S = 60.0  # ranks bound each distributed wait by the timeout; longer silence is a hang


class TrainError(RuntimeError):
    """A rank failed, died or stopped reporting; ``rank`` is the first culprit."""

    def __init__(self, message: str, rank: int, traceback_text: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback_text


class _Progress:
    """Rank 0's progress: a tqdm bar when tqdm is importable, else one carriage-return line.

    Start-up (spawning the ranks, building the model, ``initialize``) is reported on its own
    line by :meth:`start`; the bar starts then, so its times and ETA count training steps only.
    Its one throughput figure is the average since the first step, as in the closing table.
    """

    _BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

    def __init__(self, total: int, enabled: bool, tokens_per_step: int) -> None:
        self.total = total
        self.enabled = enabled
        self.tokens_per_step = tokens_per_step
        self._bar: Any = None
        self._step_seconds = 0.0
        self._started = False

    def start(self, world: int, startup_seconds: float) -> None:
        """Every rank is initialized after ``startup_seconds``: say so and start the bar."""
        if not self.enabled or self._started:
            return
        self._started = True
        print(
            f"zero train: {world} ranks started in {startup_seconds:.1f} s (processes, model, initialize)",
            file=sys.stderr,
            flush=True,
        )
        if importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, desc="zero train", unit="step", file=sys.stderr, bar_format=self._BAR_FORMAT
            )

    def update(self, step: int, loss: float, seconds: float) -> None:
        """Rank 0 finished optimizer step ``step`` (1-based) in ``seconds`` with this mean ``loss``."""
        if not self.enabled:
            return
        self._step_seconds += seconds
        done = self.tokens_per_step * step
        rate = done / self._step_seconds if self._step_seconds > 0 else float("inf")
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} tokens/s", refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            line = f"\rzero train: step {step}/{self.total}  loss {loss:.4f}  {rate:,.0f} tokens/s"
            print(line, end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar (or the line)."""
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self._started:
            print(file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Watch:
    """What the launcher hears from the ranks while they run: start-up, steps, rank 0's progress."""

    world: int
    progress: _Progress
    launched: float
    last_step: dict[int, int] = dataclasses.field(default_factory=dict)
    ready: set[int] = dataclasses.field(default_factory=set)
    startup_seconds: float = 0.0

    def on_message(self, rank: int, msg: tuple[Any, ...]) -> None:
        """A rank's report: ``("ready",)`` or ``("step", step, loss, seconds)``."""
        if msg[0] == "ready":
            self.ready.add(rank)
            if len(self.ready) == self.world:
                self.startup_seconds = time.monotonic() - self.launched
                self.progress.start(self.world, self.startup_seconds)
        else:
            self.last_step[rank] = msg[1]
            if rank == 0:
                self.progress.update(msg[1], msg[2], msg[3])

    def describe(self, failure: RankFailure) -> str:
        """``"rank 1 exited (code 17) after step 1 without reporting an error"``, ..."""
        rank, step = failure.rank, self.last_step.get(failure.rank, 0)
        if failure.kind is RankFailureKind.RAISED:
            where = "during setup" if step == 0 else f"after step {step}"
            return f"rank {rank} failed {where}: {failure.summary.removeprefix('raised ')}"
        return f"rank {rank} {failure.summary} after step {step} without reporting an error"

    def error(self, exc: LaunchError, silence: float) -> TrainError:
        """The :class:`TrainError` of a failed launch: the first culprit, then the others."""
        first = exc.failures[0]
        if first.kind is RankFailureKind.TIMED_OUT:
            steps = ", ".join(f"rank {r}: step {self.last_step.get(r, 0)}" for r in exc.still_running)
            return TrainError(
                f"zero train failed: no rank reported for {silence:g} s (last reports: {steps}); killed",
                first.rank,
            )
        text = self.describe(first)
        same = text.split(" ", 2)[2]  # the text without "rank N "
        others = []
        for failure in exc.failures[1:]:
            if failure.kind is RankFailureKind.TIMED_OUT:
                continue
            other = self.describe(failure)
            same_way = other.split(" ", 2)[2] == same
            others.append(f"  rank {failure.rank} failed the same way" if same_way else f"  {other}")
        if exc.still_running:
            others.append(f"  rank(s) {list(exc.still_running)} were still running and have been stopped")
        message = f"zero train failed: {text}"
        if others:
            message += "\nthen:\n" + "\n".join(others)
        return TrainError(message, first.rank, first.traceback)


def run_training(opts: TrainOptions) -> TrainSummary:
    """Train the demo model on ``opts.world`` launched local ranks."""
    opts.validate()
    require_transformers()
    config = build_config(opts)
    cfg = ZeroConfig.model_validate(config)
    batch = cfg.resolve_batch(opts.world)
    rpn = opts.ranks_per_node or opts.world
    progress = _Progress(opts.steps, opts.progress, batch.train_batch_size * opts.seq)
    watch = _Watch(opts.world, progress, time.monotonic())
    # MALLOC_MMAP_THRESHOLD_: freed blocks >= 1 MiB leave the RSS, so the memory rows follow live tensors.
    env = {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576")}
    silence = opts.timeout + _SILENCE_MARGIN_S
    try:
        answers = launch(
            train_rank,
            opts.world,
            opts,
            config,
            timeout=silence,
            quiet=True,
            pg_timeout=opts.timeout,
            ranks_per_node=rpn,
            env=env,
            on_message=watch.on_message,
            name="zero-train",
        )
    except LaunchError as exc:
        raise watch.error(exc, silence) from None
    finally:
        progress.close()
    results = tuple(a.value for a in answers)
    return TrainSummary(opts, cfg, rpn, results, time.monotonic() - watch.launched, watch.startup_seconds)
