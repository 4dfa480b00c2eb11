"""State transitions of one partitioned parameter and the storage behind its full value.

``NOT_AVAILABLE`` -> ``AVAILABLE`` (:func:`make_available`, over :func:`unsharded_dest` /
:func:`unsharded_view`), back (:func:`make_not_available`), writing a full value back into the
shard (:func:`reshard_from_full`), and the padded home of a persistent parameter. Torch function
handling must be disabled by the caller.
"""

from __future__ import annotations

import torch
from torch import nn

from zero_comm import AllGatherStrategy, padded_numel
from zero_params.state import ParamStatus, PartitionedParameter, ShardedParam

__all__ = [
    "make_available",
    "make_not_available",
    "materialize_uninitialized",
    "persistent_storage",
    "reshard_from_full",
    "unsharded_dest",
    "unsharded_view",
]


def make_available(p: nn.Parameter, state: ShardedParam, full: torch.Tensor) -> None:
    """Point ``p`` at ``full`` (full shape): ``AVAILABLE``.

    ``full`` is normally a view of :attr:`ShardedParam.unsharded` (see
    :func:`unsharded_view`); any other tensor (e.g. a value assigned with ``p.data = t``
    under ``Init``) is used as it is and only dropped, never emptied, on release.
    """
    p.data = full
    p.__class__ = nn.Parameter
    state.status = ParamStatus.AVAILABLE
    state.handle = None


def unsharded_view(state: ShardedParam) -> torch.Tensor:
    """The parameter's full shape over its (allocated) :class:`UnshardedStorage`."""
    return state.unsharded.flat[: state.numel].view(state.shape)


def make_not_available(p: nn.Parameter, state: ShardedParam) -> None:
    """Drop ``p``'s full data and empty its unsharded storage: ``NOT_AVAILABLE``.

    The storage is resized to 0 bytes, so the memory is freed even while autograd holds
    views of the gathered parameter; the next gather refills the same storage.
    """
    p.data = torch.empty(0, dtype=state.dtype, device=state.device)
    p.__class__ = PartitionedParameter
    state.status = ParamStatus.NOT_AVAILABLE
    state.unsharded.free()


def materialize_uninitialized(p: nn.Parameter, state: ShardedParam) -> None:
    """Give a ``NOT_AVAILABLE`` parameter its full storage, uninitialised, without communication.

    For callers that are about to overwrite every element (e.g. ``Init`` running
    ``normal_``); write the result back to the shard with :func:`reshard_from_full`.
    """
    unsharded_dest(state, state.gather_strategy)
    make_available(p, state, unsharded_view(state))


def reshard_from_full(p: nn.Parameter, state: ShardedParam) -> None:
    """Copy this rank's partition of the (gathered, possibly edited) full ``p`` into its shard.

    If ``p.data`` was replaced by a tensor of another shape or dtype, the state takes the
    new geometry (new shard size, gradient partition dropped; a persistent parameter is
    re-homed into a padded buffer its shard views). Invalidates the hpZ secondary shard.
    """
    full = p.data
    state.secondary_valid = False
    if full.shape != state.shape or full.dtype != state.dtype:
        state.shape, state.dtype, state.device = full.shape, full.dtype, full.device
        state.numel = full.numel()
        state.shard = torch.zeros(state.partition_numel, dtype=full.dtype, device=state.shard.device)
        state.grad_partition = None
        state.secondary_shard = None
        if state.persistent:
            state.shard = persistent_storage(p, state, full, state.shard.device)
            return
    if state.persistent and _views_same_storage(state.shard, full):
        return  # the shard is a view of the whole parameter: already in sync
    start, stop = state.shard_range
    if state.offload is not None:
        values = torch.zeros(state.partition_numel, dtype=state.dtype, device=full.device)
        values[: stop - start].copy_(full.reshape(-1)[start:stop])
        state.offload.replace(state, values)
        return
    if stop - start:
        state.shard[: stop - start].copy_(full.reshape(-1)[start:stop])
    state.shard[stop - start :].zero_()


def _views_same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    if a.numel() == 0 or b.numel() == 0:
        return a.numel() == b.numel() == 0
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def persistent_storage(
    p: nn.Parameter, state: ShardedParam, full: torch.Tensor, shard_device: torch.device
) -> torch.Tensor:
    """Re-home a persistent ``p`` into a zero-padded buffer; return its shard (a view where possible)."""
    part = state.partition_numel
    padded = torch.zeros(state.group_size * part, dtype=full.dtype, device=full.device)
    padded[: full.numel()].copy_(full.reshape(-1))
    p.data = padded[: full.numel()].view(full.shape)
    shard = padded[state.group_rank * part : (state.group_rank + 1) * part]
    return shard if shard_device == full.device else shard.to(shard_device)


def unsharded_dest(state: ShardedParam, strategy: AllGatherStrategy) -> torch.Tensor:
    """Refill ``state``'s storage; return the part the gather over ``strategy`` fills (padding included).

    The storage holds the padded size of the larger of the primary and hpZ secondary gathers,
    so a gather lands whole (one fused copy out of the rank-major buffer, or the collective
    writing it directly) and the parameter is its first ``numel`` elements.
    """
    size = state.padded_numel
    if state.secondary_strategy is not None:
        size = max(size, padded_numel(state.numel, state.secondary_strategy.group_size))
    flat = state.unsharded.allocate(size, state.dtype, state.device)
    return flat[: padded_numel(state.numel, strategy.group_size)]
