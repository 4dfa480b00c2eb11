"""One rank of ``zero train``: the training loop and what the rank measured.

:func:`train_rank` runs in each launched process (:func:`zero_launch.launch`, its gloo
group already joined): it builds the GPT-2 (:meth:`TrainOptions.workload`), wraps it with
:func:`zero_full.initialize`, trains on its slice of every global batch, reports ``("ready",)``
and then ``("step", step, loss, seconds)`` to the launcher, and returns a :class:`RankResult`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero_comm import CommTotals
from zero_coord import StepStats
from zero_full.cli.train.options import TrainOptions
from zero_full.cli.train.workloads import require_transformers
from zero_full.config.zero_config import ZeroConfig
from zero_full.engine import initialize
from zero_full.memory.rank_memory import read_process_memory
from zero_launch import RankContext

__all__ = ["CRASH_EXIT_CODE", "RankResult", "train_rank"]

CRASH_EXIT_CODE = 17  # the exit code of --crash-rank's rank


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What one rank measured."""

    rank: int
    num_params: int
    model_state_bytes: int
    losses: tuple[float, ...]
    comm: CommTotals
    params: StepStats
    peak_live_elements: int
    seconds: float
    tokens: int
    runtime_rss_bytes: int = 0
    rest_rss_bytes: int = 0
    step_peak_rss_bytes: int = 0
    peak_resettable: bool = True


def train_rank(ctx: RankContext, opts: TrainOptions, config: dict[str, Any]) -> RankResult:
    """Train on this rank (its process group joined); sends ``("ready",)`` once initialized, then
    ``("step", step, loss, seconds)`` after every optimizer step."""
    rank, world = ctx.rank, dist.get_world_size()
    require_transformers()
    importlib.import_module("transformers.models.gpt2.modeling_gpt2")  # the runtime, before the model
    runtime = read_process_memory().rss_bytes or 0
    workload = opts.workload()
    model = workload.build_model()
    num_params = sum(p.numel() for p in model.parameters())
    engine = initialize(model, config)
    accumulation = engine.gradient_accumulation_steps
    micro = ZeroConfig.model_validate(config).resolve_batch(world).train_micro_batch_size_per_gpu
    zero3 = engine.config.stage == 3  # only stage 3 gathers parameters (coordinator statistics)
    ctx.send(("ready",))  # start-up is over: the progress bar starts with the first step
    losses: list[float] = []
    comm, params, peak = CommTotals(), StepStats(), 0
    step_peaks: list[int] = []
    start = time.perf_counter()
    for step in range(opts.steps):
        if rank == opts.crash_rank and step == 1:
            os._exit(CRASH_EXIT_CODE)  # the failure-path check: die without a word
        engine.reset_peak_memory()  # this step's peak RSS
        t0, total = time.perf_counter(), torch.zeros((), device=engine.device)
        for m in range(accumulation):
            batch = workload.markov_batch(step * accumulation + m, micro * world)
            ids = batch[rank * micro : (rank + 1) * micro]
            logits = engine(input_ids=ids).logits  # next-token loss computed here, on any version
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            total += loss.detach() / accumulation
            if zero3:
                stats = engine.stats.params
                peak = max(peak, stats.max_live_elements)
                params = params + stats if step > 0 else params
        step_peaks.append(read_process_memory().peak_rss_bytes)
        comm = comm + engine.stats.comm
        dist.all_reduce(total)
        losses.append(total.item() / world)
        ctx.send(("step", step + 1, losses[-1], time.perf_counter() - t0))
    seconds = time.perf_counter() - start
    rest = engine.memory_report().process
    result = RankResult(
        rank=rank,
        num_params=num_params,
        model_state_bytes=engine.model_state_bytes(),
        losses=tuple(losses),
        comm=comm,
        params=params,
        peak_live_elements=peak,
        seconds=seconds,
        tokens=opts.steps * accumulation * micro * opts.seq,
        runtime_rss_bytes=runtime,
        rest_rss_bytes=rest.rss_bytes or 0,
        step_peak_rss_bytes=max(step_peaks[1:] or step_peaks),
        peak_resettable=rest.peak_resettable,
    )
    engine.close()
    return result
