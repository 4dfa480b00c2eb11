"""The engine's monitor: what one optimizer step reports, and to whom (rank 0, as DeepSpeed)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from zero_comm import CommRecord
from zero_full.checkpoint import TrainState
from zero_full.config.zero_config import Precision, ZeroConfig
from zero_full.memory.rank_memory import read_process_memory
from zero_full.monitor.comms import CommsTable
from zero_full.monitor.flops import FlopsProfiler
from zero_full.monitor.writers import Event, Writer, build_writers

__all__ = ["StepEvent", "TrainingMonitor"]

logger = logging.getLogger("zero.monitor")

StepEvent = Event

_PREFIX = "Train/Samples/"


class TrainingMonitor:
    """The writers, collective table and FLOP profiler a config asks for, on rank 0 (nothing elsewhere)."""

    def __init__(self, config: ZeroConfig, module: nn.Module, state: TrainState) -> None:
        rank0 = dist.get_rank() == 0
        self._every = config.steps_per_print if rank0 else 0
        self.writers: list[Writer] = build_writers(config) if rank0 else []
        self.comms = CommsTable(config.comms_logger) if rank0 and config.comms_logger.enabled else None
        self.flops = (
            FlopsProfiler(module, state.counters, config.flops_profiler)
            if rank0 and config.flops_profiler.enabled
            else None
        )
        self._samples_per_step = _samples_per_step(config)
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._last = time.perf_counter()

    def counting_forward(self) -> contextlib.AbstractContextManager[None]:
        """Wraps the engine's forward: counts its FLOPs at ``flops_profiler.profile_step``."""
        return self.flops.counting() if self.flops is not None else contextlib.nullcontext()

    def record_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss to the step's mean (only when some writer will log it)."""
        if self.writers:
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._losses += 1

    def after_step(self, state: TrainState, grad_norm: float | None, records: Sequence[CommRecord]) -> None:
        """Report the optimizer step just taken (``records``: its collectives, from the engine's ledger)."""
        if self._every and state.counters.global_steps % self._every == 0:
            logger.info(
                "zero: step=%d, lr=%s, loss_scale=%s",
                state.counters.global_steps,
                [g["lr"] for g in state.optimizer.param_groups],
                state.scaler.scale if state.scaler is not None else 1.0,
            )
        if self.comms is not None:
            self.comms.add(records)
        if self.flops is not None and self.flops.due():
            _print_flops(self.flops)
        if not self.writers:
            return
        now = time.perf_counter()
        events = self._events(state, grad_norm, records, now - self._last)
        self._last, self._loss_sum, self._losses = now, None, 0
        for writer in self.writers:
            writer.write(events)

    def _events(
        self, state: TrainState, grad_norm: float | None, records: Sequence[CommRecord], seconds: float
    ) -> list[Event]:
        step = state.counters.global_steps * self._samples_per_step
        values: list[tuple[str, float]] = []
        if self._loss_sum is not None:
            values.append(("train_loss", float(self._loss_sum) / self._losses))
        values.append(("lr", float(state.optimizer.param_groups[0]["lr"])))
        if state.config.precision is Precision.FP16 and state.scaler is not None:
            values.append(("loss_scale", float(state.scaler.scale)))
        if grad_norm is not None:
            values.append(("grad_norm", float(grad_norm)))
        values.append(("step_time_ms", seconds * 1e3))
        memory = read_process_memory()
        if memory.rss_bytes is not None:
            values.append(("rss_bytes", float(memory.rss_bytes)))
        values.append(("peak_rss_bytes", float(memory.peak_rss_bytes)))
        values.append(("comm_bytes_sent", float(sum(r.wire_bytes for r in records))))
        return [Event(_PREFIX + name, value, step) for name, value in values]

    def close(self) -> None:
        """Print the ``comms_logger`` table and close the writers."""
        if self.comms is not None and self.comms.rows:
            print(f"zero comms_logger (rank 0, the engine's collectives):\n{self.comms.table()}", flush=True)
            self.comms.rows.clear()
        for writer in self.writers:
            writer.close()
        self.writers = []


def _print_flops(flops: FlopsProfiler) -> None:
    text = flops.report()
    if flops.config.output_file is None:
        print(text, flush=True)
    else:
        with open(flops.config.output_file, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def _samples_per_step(config: ZeroConfig) -> int:
    if config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None:
        return 1
    return config.resolve_batch(dist.get_world_size()).train_batch_size
