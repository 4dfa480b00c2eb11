"""``communication_data_type``: which collective strategies move the parameters and gradients.

:func:`comm_strategies` turns the config key into strategy objects (``None`` where the plain
collectives are used), which :func:`zero_full.wiring.stages.build_stage` and :class:`zero_full.Init`
hand to the layers below:

* gradients, every stage: :class:`zero_comm.CastReduceScatter` (stages 1-3) or
  :class:`zero_comm.CastAllReduce` (stage 0) when the communication dtype differs from the
  working dtype; the sums and the average are computed in the working dtype after the cast back;
* parameters, stage 3: :class:`zero_comm.CastAllGather` only when the communication dtype is
  narrower than the working dtype (a wider gather would move more bytes for the same values).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

import zero_comm
import zero_params
from zero_full.config.zero_config import ZeroConfig
from zero_full.wiring.dtypes import precision_dtype, working_dtype

__all__ = ["CommStrategies", "comm_strategies"]


@dataclasses.dataclass(frozen=True)
class CommStrategies:
    """The collectives ``communication_data_type`` selects (``None``: the plain one)."""

    dtype: torch.dtype | None = None
    gather: zero_comm.CastAllGather | None = None
    reduce_scatter: zero_comm.CastReduceScatter | zero_comm.NativeReduceScatter | None = None
    all_reduce: zero_comm.CastAllReduce | None = None

    def check_partitioned(self, model: nn.Module) -> None:
        """Refuse parameters partitioned before (``zero_params.Init``) with other strategies.

        Raises:
            ValueError: a parameter was partitioned with a gather or reduce strategy that does
                not communicate in :attr:`dtype` (build the model under ``zero_full.Init(config=...)``).
        """
        if self.dtype is None:
            return
        for name, p in model.named_parameters():
            if not zero_params.is_partitioned(p):
                continue
            state = zero_params.state_of(p)
            gather_ok = self.gather is None or isinstance(state.gather_strategy, zero_comm.CastAllGather)
            if not gather_ok or not isinstance(state.reduce_strategy, zero_comm.CastReduceScatter):
                raise ValueError(
                    f"parameter {name!r} was partitioned with {state.gather_strategy!r} / "
                    f"{state.reduce_strategy!r}, but communication_data_type asks for {self.dtype}: build "
                    "the model under zero_full.Init(config=...) with the same config (not zero_params.Init)"
                )


def comm_strategies(
    config: ZeroConfig, group: ProcessGroup | None = None, *, backend: str | None = None
) -> CommStrategies:
    """The strategies for ``config.communication_data_type`` over ``group`` (``None``: the world).

    Args:
        config: The validated configuration.
        group: The data-parallel (shard) group.
        backend: Backend to choose the reduce-scatter by (``None``: ``group``'s, when initialised).
    """
    dtype = (
        precision_dtype(config.communication_data_type)
        if config.communication_data_type is not None
        else None
    )
    working = working_dtype(config)
    if dtype is None or dtype == working:
        return CommStrategies(reduce_scatter=_native_or_none(config, group, backend))
    narrower = dtype.itemsize < working.itemsize
    return CommStrategies(
        dtype=dtype,
        gather=zero_comm.CastAllGather(dtype, group) if narrower and config.stage == 3 else None,
        reduce_scatter=zero_comm.CastReduceScatter(dtype, group) if config.stage != 0 else None,
        all_reduce=zero_comm.CastAllReduce(dtype, group) if config.stage == 0 else None,
    )


def _native_or_none(
    config: ZeroConfig, group: ProcessGroup | None, backend: str | None
) -> zero_comm.NativeReduceScatter | None:
    """The native reduce-scatter where the backend has one (stages 1-3), else ``None`` (the exchange)."""
    if backend is None:
        if not dist.is_initialized():
            return None
        backend = dist.get_backend(group)
    if config.stage == 0 or not zero_comm.has_native_reduce_scatter(backend):
        return None
    return zero_comm.NativeReduceScatter(group)
