"""How parameters are partitioned: group, strategies, persistence threshold, placement."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero_comm import (
    AllGatherStrategy,
    AllToAllReduceScatter,
    FlatAllGather,
    ReduceScatterStrategy,
    group_ranks,
)

__all__ = ["ShardingSpec"]


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """One resolved partitioning configuration (what :func:`zero_params.partition` and
    :class:`zero_params.Init` apply to every parameter they partition).

    Build it with :meth:`create`, which fills in defaults and validates.
    """

    group: ProcessGroup | None
    group_ranks: tuple[int, ...]
    group_size: int
    group_rank: int
    gather_strategy: AllGatherStrategy
    reduce_strategy: ReduceScatterStrategy
    secondary_strategy: AllGatherStrategy | None
    persistence_threshold: int
    remote_device: torch.device | None
    dtype: torch.dtype | None

    @classmethod
    def create(
        cls,
        group: ProcessGroup | None = None,
        *,
        persistence_threshold: int = 0,
        gather_strategy: AllGatherStrategy | None = None,
        reduce_strategy: ReduceScatterStrategy | None = None,
        secondary_strategy: AllGatherStrategy | None = None,
        remote_device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> ShardingSpec:
        """Resolve defaults (``FlatAllGather(group)``, ``AllToAllReduceScatter(group)``) and validate.

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised.
            ValueError: a strategy runs over a group of another size or rank than ``group``,
                a negative threshold, or an unsupported ``remote_device`` / ``dtype``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "zero_params needs torch.distributed: call torch.distributed.init_process_group first "
                "(e.g. init_process_group('gloo') under torchrun)"
            )
        # The world stays ``None`` (torch's default group), never ``dist.group.WORLD`` itself: a
        # reference to that object outliving destroy_process_group() makes gloo abort at exit.
        pg = group
        ranks = group_ranks(pg)
        size, rank = len(ranks), dist.get_rank(pg)
        if rank < 0:
            raise ValueError(
                f"global rank {dist.get_rank()} is not a member of the shard group {list(ranks)}; "
                "pass a group that contains this rank (e.g. from zero_comm.Topology)"
            )
        gather = gather_strategy if gather_strategy is not None else FlatAllGather(pg)
        reduce = reduce_strategy if reduce_strategy is not None else AllToAllReduceScatter(pg)
        for what, strat in (("gather_strategy", gather), ("reduce_strategy", reduce)):
            if strat.group_size != size or strat.group_rank != rank:
                raise ValueError(
                    f"{what} {strat!r} runs over {strat.group_size} rank(s) with this rank at "
                    f"{strat.group_rank}, but the shard group has {size} rank(s) with this rank at {rank}; "
                    "build the strategy over the same group"
                )
        sec = secondary_strategy
        if sec is not None and not 0 <= sec.group_rank < sec.group_size:
            raise ValueError(f"secondary_strategy {secondary_strategy!r} reports an invalid group rank")
        if not isinstance(persistence_threshold, int) or persistence_threshold < 0:
            raise ValueError(
                f"persistence_threshold (param_persistence_threshold) must be an integer >= 0 (a numel), "
                f"got {persistence_threshold!r}"
            )
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        return cls(
            group=pg,
            group_ranks=ranks,
            group_size=size,
            group_rank=rank,
            gather_strategy=gather,
            reduce_strategy=reduce,
            secondary_strategy=secondary_strategy,
            persistence_threshold=persistence_threshold,
            remote_device=_resolve_device(remote_device),
            dtype=dtype,
        )


def _resolve_device(remote_device: str | torch.device | None) -> torch.device | None:
    if remote_device is None:
        return None
    if isinstance(remote_device, str) and remote_device.lower() in ("none", ""):
        return None
    try:
        device = torch.device(remote_device)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type == "meta":
        raise ValueError(
            f"remote_device={remote_device!r} is not supported: use None (shards stay with the "
            "parameter) or 'cpu' (NVMe placement of parameters belongs to zero_offload)"
        )
    return device
