"""One implementation's training steps measured in fresh ranks: RSS at rest, what forward holds, peaks.

The memory benchmark (``python -m benchmarks memory``) and the growth benchmark both measure
through :func:`rank_main` / :func:`measure_rank` and tabulate with :func:`summarize`; the steps
are described in the memory benchmark's docstring. Every rank runs with :data:`MEASURED_ENV`
(glibc returns every freed block of 1 MiB or more to the kernel, so the RSS follows the live
tensors).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib
import logging
import os
import time
import warnings
from typing import Any

from benchmarks.kit.impls import (
    IMPLEMENTATIONS,
    ImplOptions,
    formula_state_bytes,
    leaf_threshold,
    model_state_bytes,
)
from benchmarks.kit.measure import peak_rss_bytes, reset_peak_rss, rss_bytes
from benchmarks.kit.workloads import Workload, build_model, global_batch, num_params, rank_slice

IMPLS = (
    "ddp",
    "fsdp2",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
    "zero-1",
    "zero-2",
    "zero-3",
    "zero-3+ckpt",
    "zero-3+leaf",
    "zero-1+defaults",
    "zero-2+defaults",
    "zero-3+defaults",
    "zero-3+dsdefaults",
)
# What a suffix of an implementation's name changes in RELEASE: activation checkpointing of every
# block; each GPT-2 block gathered as one leaf (the side-by-side's stage3_module_granularity_threshold).
# "+defaults": an empty zero_optimization section (the stage only: zero's defaults, sized from the
# model); "+dsdefaults": DeepSpeed's default sizes given explicitly (an empty section before zero
# sized its defaults).
VARIANTS = {
    "+ckpt": {"checkpointing": True},
    "+leaf": {"leaf_blocks": True},
    "+defaults": {"sizes": "unset"},
    "+dsdefaults": {"sizes": "deepspeed"},
}
# Stage 3 (zero and DeepSpeed) really releases: nothing persists, one block prefetched, two live.
# Every stage (zero and DeepSpeed alike) bounds its transients by the config: reduce / all-gather
# buckets of one block and an optimizer that steps one block's elements at a time; overlap_comm
# and zero's reduce_max_inflight at each implementation's default (overlap_comm false at stage 2,
# true at stage 3; one reduction in flight); stage 3 gathers per module (no granularity threshold).
RELEASE = ImplOptions(
    persistence_threshold=0,
    prefetch_blocks=1.0,
    live_blocks=2.0,
    **dict.fromkeys(("bucket_blocks", "sub_group_blocks"), 1.0),
    **dict.fromkeys(("overlap_comm", "reduce_max_inflight"), None),
    leaf_blocks=False,
)
MEASURED_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


@dataclasses.dataclass(frozen=True)
class Run:
    """One implementation on one workload at one world size (what the ranks receive)."""

    impl: str
    workload: Workload
    world: int
    warmup: int
    steps: int
    timeout: float


def split_impl(impl: str) -> tuple[str, ImplOptions]:
    """The ``IMPLEMENTATIONS`` name and the options of a benchmark implementation name.

    ``zero-3+ckpt`` is ``zero-3`` with activation checkpointing, ``zero-3+leaf`` with each GPT-2
    block gathered as one leaf (:data:`VARIANTS`); every implementation gets the :data:`RELEASE`
    policy (only stage 3 reads it).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}: choose from {', '.join(IMPLS)}")
    base, plus, suffix = impl.partition("+")
    return base, dataclasses.replace(RELEASE, **VARIANTS.get(plus + suffix, {}))


def impls_for(impls: list[str], w: Workload) -> list[str]:
    """The implementations of ``impls`` that measure something of their own on ``w``.

    A variant asking for block leaves (``zero-3+leaf``) runs only where
    :func:`benchmarks.kit.impls.leaf_threshold` sets a threshold (GPT-2: a Linear stack has no
    blocks); elsewhere it would be a second ``zero-3`` row.
    """
    kept = []
    for impl in impls:
        options = split_impl(impl)[1]
        if not options.leaf_blocks or leaf_threshold(w, options) is not None:
            kept.append(impl)
    return kept


def formula_bytes(impl: str, psi: int, world: int) -> float:
    """The fp32 AdamW ZeRO formula of ``impl`` (checkpointing changes activations, not model states)."""
    return formula_state_bytes(split_impl(impl)[0], psi, world)


# ----------------------------------------------------------------------------- one rank


def _import_libraries(impl: str, w: Workload) -> None:
    """Everything the implementation imports before it builds the model (part of the baseline).

    ``torch._dynamo`` (about 140 MB of RSS) is imported by every implementation, lazily by DDP's
    and FSDP2's constructors: imported here, it is part of everyone's baseline.
    """
    names = ["torch._dynamo", *(["torch.distributed.fsdp"] if impl == "fsdp2" else [])]
    if w.kind == "gpt2":
        names += [
            "transformers.models.gpt2.modeling_gpt2",
            "zero_full.cli.train.workloads",
        ]  # the model's builder
    if impl.startswith("deepspeed"):
        names.append("deepspeed")
    if impl.startswith("zero"):
        names.append("zero_full")
    for name in names:
        importlib.import_module(name)


def _settle() -> int:
    """RSS after a garbage collection (no cycle left holding tensors)."""
    gc.collect()
    return rss_bytes()


def measure_rank(run: Run, rank: int) -> dict[str, Any]:
    """Steps 1-5 of the module docstring on this rank (the process group is up)."""
    import torch.distributed as dist

    w, world = run.workload, run.world
    dist.barrier()  # gloo's connections are open: the runtime is complete
    runtime = _settle()
    _import_libraries(run.impl, w)
    baseline = _settle()
    base, options = split_impl(run.impl)
    runner = IMPLEMENTATIONS[base](w, world, options)
    total = run.warmup + run.steps + 1
    batches = [rank_slice(global_batch(w, s, world), rank, world) for s in range(total)]
    for s in range(run.warmup):
        runner.forward_backward(batches[s])
        runner.optimizer_step()
    steps = []
    for s in range(run.warmup, run.warmup + run.steps):
        dist.barrier()
        rest = _settle()
        reset_peak_rss()
        start = time.perf_counter()
        loss = runner.forward(batches[s])
        forward = rss_bytes()
        forward_peak = peak_rss_bytes()
        reset_peak_rss()  # VmHWM restarts at the current RSS: each phase's peak, the step's is their max
        runner.backward(loss)
        backward_peak = peak_rss_bytes()
        reset_peak_rss()
        runner.optimizer_step()
        step_peak = peak_rss_bytes()
        seconds = time.perf_counter() - start  # growth.py's step time (the peak readings included)
        steps.append(
            {
                "rest": rest,
                "forward": forward,
                "peak": max(forward_peak, backward_peak, step_peak),
                "backward_peak": backward_peak,
                "optimizer_peak": step_peak,
                "loss": loss.item(),
                "seconds": seconds,
            }
        )
        del loss
    runner.forward_backward(batches[-1])
    state = model_state_bytes(runner)
    runner.optimizer_step()
    runner.close()
    return rank_figures(rank, runtime, baseline, steps, state)


def rank_figures(
    rank: int, runtime: int, baseline: int, steps: list[dict[str, Any]], state: int
) -> dict[str, Any]:
    """One rank's figures as :func:`summarize` reads them (``steps``: one dict per measured step)."""
    return {
        "rank": rank,
        "runtime": runtime,
        "baseline": baseline,
        "steps": steps,
        "model_state_bytes": state,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def rank_main(rank: int, run: Run, store: str, results: Any) -> None:
    """Process entry of one rank: measure, gather every rank's figures, rank 0 reports them."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(run.world),
        LOCAL_WORLD_SIZE=str(run.world),
        MASTER_ADDR="127.0.0.1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    timeout = datetime.timedelta(seconds=run.timeout)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=run.world, timeout=timeout
    )
    mine = measure_rank(run, rank)
    gathered: list[Any] = [None] * run.world
    dist.all_gather_object(gathered, mine)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(gathered)


# ----------------------------------------------------------------------------- aggregation


def summarize(impl: str, workload: str, world: int, psi: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from every rank's figures: the largest rank's, over the measured steps.

    rest = RSS at rest - baseline; forward = what forward added and held; peak_added = peak
    RSS of the step - its rest; step_peak = rest + peak_added (the step's peak above the
    baseline); imports = baseline - runtime.
    """

    def worst(value: Any) -> int:
        return max(value(r, s) for r in ranks for s in r["steps"])

    def phase_added(key: str) -> int | None:
        # backward / optimizer-step peaks: recorded by this script's ranks, not by every caller's
        if all(key in s for r in ranks for s in r["steps"]):
            return worst(lambda r, s: s[key] - s["rest"])
        return None

    rest = worst(lambda r, s: s["rest"] - r["baseline"])
    return {
        "impl": impl,
        "workload": workload,
        "world": world,
        "psi": psi,
        "runtime_bytes": max(r["runtime"] for r in ranks),
        "imports_bytes": max(r["baseline"] - r["runtime"] for r in ranks),
        "rest_bytes": rest,
        "forward_bytes": worst(lambda r, s: s["forward"] - s["rest"]),
        "peak_added_bytes": worst(lambda r, s: s["peak"] - s["rest"]),
        "backward_added_bytes": phase_added("backward_peak"),
        "optimizer_added_bytes": phase_added("optimizer_peak"),
        "step_peak_bytes": worst(lambda r, s: s["peak"] - r["baseline"]),
        "formula_bytes": formula_bytes(impl, psi, world),
        "model_state_bytes": max(r["model_state_bytes"] for r in ranks),
        "error": None,
    }


def failed_row(impl: str, workload: str, world: int, psi: int, error: str) -> dict[str, Any]:
    """The row of a run that did not finish (a dead rank, a timeout): its error, no figures."""
    return {"impl": impl, "workload": workload, "world": world, "psi": psi, "error": error}


def count_params(w: Workload) -> int:
    """P of the workload's model, built on the meta device (no memory, no time)."""
    import torch

    with torch.device("meta"):
        return num_params(build_model(w))
