"""``engine.memory_report()``: this rank's real memory next to the ZeRO formula.

A :class:`MemoryReport` holds, for one rank at one moment:

* the process's resident memory (RSS now and its peak since the last reset, from
  ``/proc/self/status``; see :mod:`zero_full.memory.rank_memory`) — the evidence on CPU;
* the accelerator's allocated bytes and their peak (``torch.accelerator``), when there is one;
* the model-state bytes counted from the engine's own storages (a second figure: what the
  engine believes it holds, not what the process holds);
* the ZeRO formula's bytes for this stage, precision and partition group size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import zero_optim
import zero_params
from zero_comm.units import format_bytes
from zero_full.checkpoint.state import TrainState
from zero_full.config.zero_config import Precision
from zero_full.memory.estimate import EstimatePrecision, estimate_model_states
from zero_full.memory.rank_memory import DeviceMemory, ProcessMemory, read_device_memory, read_process_memory

__all__ = ["MemoryReport", "build_memory_report", "model_state_bytes"]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """One rank's memory at one moment (see :meth:`zero_full.Engine.memory_report`)."""

    rank: int
    global_steps: int
    process: ProcessMemory
    device: DeviceMemory | None
    model_state_bytes: int
    formula_bytes: float
    formula: str
    num_params: int
    offloaded_device_bytes: int = 0
    """Device bytes optimizer offload keeps in host memory (see ``PartitionedOptimizer``)."""

    def __str__(self) -> str:
        proc = self.process
        rss = "RSS unknown" if proc.rss_bytes is None else f"RSS {format_bytes(proc.rss_bytes)}"
        since = "since the last reset" if proc.peak_resettable else "since the process started"
        peak = format_bytes(proc.peak_rss_bytes)
        parts = [f"rank {self.rank} step {self.global_steps}: {rss}, peak {peak} {since}"]
        if self.device is not None:
            dev = self.device
            parts.append(
                f"{dev.device} allocated {format_bytes(dev.allocated_bytes)}, "
                f"peak {format_bytes(dev.peak_allocated_bytes)}, reserved {format_bytes(dev.reserved_bytes)}"
            )
        parts.append(
            f"model states {format_bytes(self.model_state_bytes)} counted, "
            f"{format_bytes(self.formula_bytes)} by {self.formula}"
        )
        if self.offloaded_device_bytes:
            saved = format_bytes(self.offloaded_device_bytes)
            parts.append(f"{saved} kept off the device by optimizer offload")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (bytes as numbers, the source as its string)."""
        data = dataclasses.asdict(self)
        data["process"]["source"] = self.process.source.value
        return data


def _num_params(module: nn.Module) -> int:
    unique = dict.fromkeys(module.parameters())
    return sum(zero_params.full_shape(p).numel() for p in unique)


def _frozen_int8_numel(module: nn.Module) -> int:
    """F: elements of the parameters whose shards are int8 (``zero_quantized_nontrainable_weights``)."""
    unique = dict.fromkeys(module.parameters())
    return sum(
        zero_params.state_of(p).numel
        for p in unique
        if zero_params.is_partitioned(p)
        and isinstance(zero_params.state_of(p).offload, zero_params.FrozenInt8Store)
    )


def _formula(state: TrainState, num_params: int, world: int) -> tuple[float, str]:
    cfg = state.config
    precision = EstimatePrecision.FP32 if cfg.precision is Precision.FP32 else EstimatePrecision.MIXED
    z = cfg.zero_optimization
    shard = z.mics_shard_size if cfg.stage == 3 and z.mics_enabled else None
    hpz = z.zero_hpz_partition_size if cfg.stage == 3 and 1 < z.zero_hpz_partition_size < world else None
    frozen = (
        _frozen_int8_numel(state.module) if cfg.stage == 3 and z.zero_quantized_nontrainable_weights else None
    )
    est = estimate_model_states(max(num_params, 1), world, precision, (cfg.stage,), shard, hpz, frozen)
    entry = est.stages[-1]  # the last entry combines every option given (MiCS, hpZ, int8 frozen)
    details = [precision.value, f"N = {world}"]
    if shard is not None:
        details.append(f"MiCS S = {shard}")
    if hpz is not None:
        details.append(f"hpZ n = {hpz}")
    if frozen is not None:
        details.append(f"int8 frozen F = {frozen}")
    return entry.total_bytes, f"ZeRO-{cfg.stage} {entry.formula(precision)} ({', '.join(details)})"


def build_memory_report(state: TrainState, rank: int, world: int) -> MemoryReport:
    """Read this rank's memory now (no collective: every rank reads its own)."""
    num_params = _num_params(state.module)
    formula_bytes, formula = _formula(state, num_params, world)
    return MemoryReport(
        rank=rank,
        global_steps=state.counters.global_steps,
        process=read_process_memory(),
        device=read_device_memory(),
        model_state_bytes=model_state_bytes(state.module, state.optimizer),
        formula_bytes=formula_bytes,
        formula=formula,
        num_params=num_params,
        offloaded_device_bytes=state.optimizer.offloaded_device_bytes,
    )


def model_state_bytes(module: nn.Module, optimizer: zero_optim.PartitionedOptimizer) -> int:
    """Bytes of this rank's model states: parameters, gradients and optimizer state.

    Counted from tensor storages, each storage once: parameter storages (empty for
    partitioned parameters that are not gathered, whole for persistent ones), the flat
    fp32 master (which holds the shards), the hpZ secondary shards, the flat gradient
    partitions, any ``.grad`` still attached and the optimizer state.
    """
    tensors: list[torch.Tensor] = []
    stores: dict[int, zero_params.FrozenInt8Store] = {}
    for p in module.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
        if zero_params.is_partitioned(p):
            state = zero_params.state_of(p)
            tensors.append(state.shard)
            if isinstance(state.offload, zero_params.FrozenInt8Store):  # int8 frozen shards
                stores[id(state.offload)] = state.offload
            if state.secondary_shard is not None:  # hpZ
                tensors.append(state.secondary_shard)
            if state.grad_partition is not None:
                tensors.append(state.grad_partition)
    for store in stores.values():
        tensors.extend(store.tensors())
    tensors.extend(optimizer.state_tensors())
    offloaded = zero_optim.offloaded_shards(optimizer)
    if offloaded is not None:
        tensors.extend(offloaded.host_tensors())
    storages: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
