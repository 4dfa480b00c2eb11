"""Input checks shared by the collectives, with messages naming the culprit and the fix."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["check_flat_inputs", "require_process_group"]

_NO_GROUP = (
    "torch.distributed has no default process group: call torch.distributed.init_process_group first "
    "(e.g. init_process_group('gloo') under torchrun)"
)


def require_process_group(what: str) -> None:
    """Raise ``RuntimeError`` unless the default process group is initialised.

    Args:
        what: The operation that needs it (used in the message).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what}: {_NO_GROUP}")


def check_flat_inputs(tensors: Sequence[torch.Tensor], what: str, *, require_1d: bool) -> None:
    """Validate the tensor list a coalesced collective receives."""
    if isinstance(tensors, torch.Tensor):
        raise ValueError(f"{what} takes a sequence of tensors, got a single tensor: wrap it as [tensor]")
    if len(tensors) == 0:
        raise ValueError(f"{what} got an empty list of tensors: pass at least one tensor")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: input {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype != first.dtype:
            raise ValueError(
                f"{what}: input {i} has dtype {t.dtype} but input 0 has {first.dtype}; "
                "coalesced collectives need one dtype (cast, or make one call per dtype)"
            )
        if t.device != first.device:
            raise ValueError(
                f"{what}: input {i} is on {t.device} but input 0 is on {first.device}; "
                "move all inputs to one device"
            )
        if require_1d and t.dim() != 1:
            raise ValueError(
                f"{what}: input {i} has shape {tuple(t.shape)}; shards must be 1-D (use .view(-1))"
            )
        if not t.is_contiguous():
            raise ValueError(f"{what}: input {i} is not contiguous; pass .contiguous() instead")
