"""Global gradient-norm clipping over partitioned gradients (``gradient_clipping``).

Each element of every trained parameter's gradient lives in exactly one rank's fp32
gradient partition (padding is zero), so the squared norm of the whole model's gradient
is the sum over ranks of the local squared norms: one all-reduce. When the partitions are
replicas (stage 0: every rank owns every element) the local sum already is the global one
and no communication is needed. The clip coefficient is torch's:
``max_norm / (total_norm + 1e-6)``, applied when below 1, as
``torch.nn.utils.clip_grad_norm_`` does on the full model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

import zero_comm
from zero_optim.flat import FlatGroup

__all__ = ["clip_grad_norm_", "global_grad_norm"]

_CHUNK = 1 << 20
"""Gradient elements squared in float64 at once (bounds the norm's temporaries)."""


def global_grad_norm(
    groups: Sequence[FlatGroup], group: ProcessGroup | None = None, *, partitioned: bool = True
) -> float:
    """The L2 norm of the whole model's gradient from the flat gradient partitions."""
    with record_function("zero.optim.grad_norm"):
        device = groups[0].grad.device if groups else zero_comm.control_device(group)
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        for g in groups:
            for grad in g.grads():
                for chunk in grad.split(_CHUNK):  # bounded float64 temporaries
                    sq += chunk.double().pow(2).sum()
        if partitioned and dist.is_available() and dist.is_initialized():
            sq = _served(sq, group)  # host-resident partitions (optimizer offload): sent from the device
            zero_comm.all_reduce(sq, group, op="sum")
        return math.sqrt(sq.item()) if sq.item() >= 0 else float("nan")


def _served(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``t``, moved to the group's control device when the group does not serve its device."""
    if t.device.type in zero_comm.served_device_types(group):
        return t
    return t.to(zero_comm.control_device(group))


def clip_grad_norm_(
    groups: Sequence[FlatGroup],
    max_norm: float,
    group: ProcessGroup | None = None,
    *,
    partitioned: bool = True,
) -> float:
    """Scale the gradient partitions so the global norm is at most ``max_norm``."""
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    norm = global_grad_norm(groups, group, partitioned=partitioned)
    with record_function("zero.optim.clip"), torch.no_grad():
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in groups:
                for grad in g.grads():
                    grad.mul_(coef)
    return norm
