"""partition: keep this rank's shard of each parameter and free the rest (no communication)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from zero_comm import AllGatherStrategy, ReduceScatterStrategy, partition_numel, shard_range
from zero_params.spec import ShardingSpec
from zero_params.state import STATE_ATTR, ParamStatus, PartitionedParameter, ShardedParam
from zero_params.transitions import persistent_storage

__all__ = ["ParamsLike", "meta_target_device", "named_params", "partition", "partition_with"]

ParamsLike = nn.Module | nn.Parameter | Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]]


def partition(
    params: ParamsLike,
    group: ProcessGroup | None = None,
    *,
    persistence_threshold: int = 0,
    gather_strategy: AllGatherStrategy | None = None,
    reduce_strategy: ReduceScatterStrategy | None = None,
    secondary_strategy: AllGatherStrategy | None = None,
    remote_device: str | torch.device | None = None,
) -> list[ShardedParam]:
    """Partition parameters over ``group``: keep this rank's shard, free the rest."""
    spec = ShardingSpec.create(
        group,
        persistence_threshold=persistence_threshold,
        gather_strategy=gather_strategy,
        reduce_strategy=reduce_strategy,
        secondary_strategy=secondary_strategy,
        remote_device=remote_device,
    )
    return partition_with(spec, named_params(params))


def named_params(params: ParamsLike) -> list[tuple[str, nn.Parameter]]:
    """Normalise the accepted parameter collections to ``(name, param)`` pairs."""
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, torch.Tensor):
        return [("", params)]
    out: list[tuple[str, nn.Parameter]] = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append(item)
        else:
            out.append(("", item))
    return out


def partition_with(spec: ShardingSpec, named: Sequence[tuple[str, nn.Parameter]]) -> list[ShardedParam]:
    """:func:`partition` with a resolved :class:`ShardingSpec`."""
    out: list[ShardedParam] = []
    seen: set[int] = set()
    with record_function("zero.params.partition"), torch._C.DisableTorchFunction(), torch.no_grad():
        for name, p in named:
            if id(p) in seen:
                continue
            seen.add(id(p))
            state = getattr(p, STATE_ATTR, None)
            if isinstance(state, ShardedParam):
                if state.group_ranks != spec.group_ranks:
                    raise ValueError(
                        f"parameter {state.display_name!r} is already partitioned over ranks "
                        f"{list(state.group_ranks)}, not over {list(spec.group_ranks)}"
                    )
                if name and not state.name:
                    state.name = name
                out.append(state)
                continue
            out.append(_partition_one(spec, name, p))
    return out


def _check_param(name: str, p: Any) -> None:
    label = repr(name) if name else "<unnamed>"
    if type(p) is not nn.Parameter:
        raise TypeError(
            f"parameter {label}: zero_params partitions plain nn.Parameter objects, got {type(p).__name__}"
        )
    if p.layout != torch.strided:
        raise TypeError(
            f"parameter {label}: cannot partition a non-strided ({p.layout}) tensor; "
            "convert it to a dense (torch.strided) tensor first"
        )


def meta_target_device() -> torch.device:
    """Where a parameter built on the ``meta`` device lives once partitioned: the current
    accelerator when there is one, else the CPU."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _partition_one(spec: ShardingSpec, name: str, p: nn.Parameter) -> ShardedParam:
    """Partition one plain parameter (torch function handling disabled by the caller)."""
    _check_param(name, p)
    data = p.data
    if spec.dtype is not None and data.is_floating_point() and data.dtype != spec.dtype:
        data = data.to(spec.dtype)
    size, rank = spec.group_size, spec.group_rank
    numel = data.numel()
    persistent = numel <= spec.persistence_threshold
    device = data.device
    if data.is_meta:
        device = meta_target_device()
        # a meta tensor's .data cannot be re-pointed to another device: swap in a real (empty) one
        torch.utils.swap_tensors(
            p, nn.Parameter(torch.empty(0, dtype=data.dtype, device=device), requires_grad=p.requires_grad)
        )
        if persistent:
            data = torch.zeros(data.shape, dtype=data.dtype, device=device)
    shard_device = spec.remote_device if spec.remote_device is not None else device
    if persistent:
        shard = torch.empty(0, dtype=data.dtype, device=shard_device)  # replaced below
    else:
        shard = torch.zeros(partition_numel(numel, size), dtype=data.dtype, device=shard_device)
        if not data.is_meta:
            start, stop = shard_range(numel, size, rank)
            shard[: stop - start].copy_(data.reshape(-1)[start:stop])
    state = ShardedParam(
        id=0,
        name=name,
        shape=data.shape,
        dtype=data.dtype,
        device=device,
        numel=numel,
        group=spec.group,
        group_ranks=spec.group_ranks,
        group_size=size,
        group_rank=rank,
        shard=shard,
        gather_strategy=spec.gather_strategy,
        reduce_strategy=spec.reduce_strategy,
        persistent=persistent,
        status=ParamStatus.AVAILABLE if persistent else ParamStatus.NOT_AVAILABLE,
        secondary_strategy=spec.secondary_strategy,
    )
    state.id = id(state)
    setattr(p, STATE_ATTR, state)
    if persistent:
        state.shard = persistent_storage(p, state, data, shard_device)
    else:
        p.data = torch.empty(0, dtype=data.dtype, device=device)
        p.__class__ = PartitionedParameter
    return state
