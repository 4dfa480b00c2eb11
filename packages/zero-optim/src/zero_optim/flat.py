"""Flat buffers of one parameter group: the fp32 master, the fp32 gradient partition, the working copy.

Each parameter of a group owns one :class:`Segment` of this rank's flat buffers: the
elements of its partition (a ZeRO-3 shard, padding included) laid out parameter after
parameter. The optimizer steps the whole ``master`` tensor at once with ``grad`` as its
gradient; per-parameter tensors (shards, gradient partitions) are views into the flat
buffers, so nothing is copied per parameter on the hot path.

``working`` is the tensor the forward pass reads this rank's values from. In fp32 training
it *is* ``master`` (one fp32 copy of the parameters); a lower working precision gets its
own flat buffer, refreshed from the master after each step (:meth:`FlatGroup.publish`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["FlatGroup", "Segment"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Where one parameter's partition lives in its group's flat buffers.

    Attributes:
        param: The model parameter.
        name: Its qualified name (for messages and state dicts).
        offset: First element in the flat buffers.
        numel: Elements of this rank's partition (padding included).
    """

    param: nn.Parameter
    name: str
    offset: int
    numel: int


class FlatGroup:
    """The flat buffers of one optimizer parameter group on this rank.

    Args:
        params: The group's trainable parameters, in order.
        names: Their qualified names.
        numels: Elements of each parameter's partition on this rank.
        device: Where the buffers live.
        working_dtype: dtype of the working copy; ``torch.float32`` shares the master.

    Attributes:
        segments: One per parameter, in order.
        master: fp32 flat tensor of this rank's partitions; what the torch optimizer steps.
        grad: fp32 flat gradient partition (``master.grad`` is this tensor).
        working: The values the model computes with (``master`` itself in fp32).
    """

    __slots__ = ("grad", "master", "segments", "working")

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        numels: Sequence[int],
        device: torch.device,
        working_dtype: torch.dtype = torch.float32,
    ) -> None:
        segments: list[Segment] = []
        offset = 0
        for param, name, numel in zip(params, names, numels, strict=True):
            segments.append(Segment(param, name, offset, int(numel)))
            offset += int(numel)
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.master = torch.zeros(offset, dtype=torch.float32, device=device)
        self.grad = torch.zeros(offset, dtype=torch.float32, device=device)
        self.master.grad = self.grad
        self.working = (
            self.master
            if working_dtype == torch.float32
            else torch.zeros(offset, dtype=working_dtype, device=device)
        )

    @property
    def numel(self) -> int:
        """Elements of the flat buffers (sum of the partitions)."""
        return self.master.numel()

    def master_view(self, seg: Segment) -> torch.Tensor:
        """The 1-D fp32 master view of one segment."""
        return self.master.narrow(0, seg.offset, seg.numel)

    def grad_view(self, seg: Segment) -> torch.Tensor:
        """The 1-D fp32 gradient-partition view of one segment."""
        return self.grad.narrow(0, seg.offset, seg.numel)

    def working_view(self, seg: Segment) -> torch.Tensor:
        """The 1-D working-precision view of one segment (the master view in fp32)."""
        return self.working.narrow(0, seg.offset, seg.numel)

    def publish(self) -> None:
        """Refresh the working copy from the master after a step (nothing to do in fp32)."""
        if self.working is not self.master:
            self.working.copy_(self.master)
