"""MiCS: the stage-3 optimizer over a shard group, replicated across replicate groups.

MiCS partitions parameters, gradients and optimizer state over a *shard group* of ``p``
ranks (``zero_params.partition(model, shard_group)``) and replicates that partition across
the ``r = N / p`` shard groups. The optimizer is the ZeRO-3 one
(:func:`zero_optim.stage3_optimizer`) over the shard-group partition, unchanged; what MiCS
adds is the second hop of the gradient synchronisation:

1. every micro-step, the coordinator's sink reduce-scatters each gradient inside the shard
   group (averaged over ``p``) and *accumulates* it into the fp32 gradient partitions;
2. at the accumulation boundary only, :class:`ReplicaGradientSync` all-reduces those
   partitions across the replicate group (averaged over ``r``), once per optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

import zero_comm
from zero_optim.core import PartitionedOptimizer
from zero_optim.flat import FlatGroup

__all__ = ["ReplicaGradientSync", "ReplicaMismatchError", "check_replicas_consistent"]


class ReplicaGradientSync:
    """The second MiCS hop: average the gradient partitions over the replicate group at the boundary."""

    __slots__ = ("_groups", "boundaries", "group", "replicas")

    def __init__(self, groups: Sequence[FlatGroup], group: ProcessGroup) -> None:
        self._groups = tuple(groups)
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.boundaries = 0

    def __repr__(self) -> str:
        return f"ReplicaGradientSync(replicas={self.replicas}, boundaries={self.boundaries})"

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Nothing to do: the shard-group reduce-scatter accumulates every micro-step."""

    def at_boundary(self) -> None:
        """All-reduce (average) every gradient partition over the replicate group; every rank calls it."""
        self.boundaries += 1
        if self.replicas == 1:
            return
        grads = [grad for g in self._groups for grad in g.grads()]
        if not grads:
            return
        with record_function("zero.optim.replica_all_reduce"), torch.no_grad():
            if grads[0].device.type not in zero_comm.served_device_types(self.group):  # host-resident
                flat = zero_comm.all_reduce(
                    torch.cat(grads).to(zero_comm.control_device(self.group)), self.group, op="avg"
                )
                for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                    g.copy_(part)
                return
            if len(grads) == 1:
                zero_comm.all_reduce(grads[0], self.group, op="avg")
                return
            flat = zero_comm.all_reduce(torch.cat(grads), self.group, op="avg")
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part)

    def remove(self) -> None:
        """Nothing installed."""


class ReplicaMismatchError(RuntimeError):
    """Replicas of a MiCS partition hold different optimizer state (names the first difference)."""


def _checked_tensors(opt: PartitionedOptimizer) -> Iterator[tuple[str, FlatGroup, torch.Tensor, bool]]:
    """``(what, group, tensor, per_element)``: each group's master, then its optimizer state tensors."""
    for gi, group in enumerate(opt.groups):
        yield f"group {gi} fp32 master", group, group.master, True
        state = opt.torch_optimizer.state.get(group.master, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                per_element = value.dim() == 1 and value.shape == group.master.shape
                yield f"group {gi} optimizer state {key!r}", group, value, per_element


def _checksums(opt: PartitionedOptimizer) -> tuple[torch.Tensor, list[str]]:
    """float64 ``(sum, sum of squares)`` per parameter segment of every checked tensor, and labels."""
    values: list[torch.Tensor] = []
    labels: list[str] = []
    for what, group, tensor, per_element in _checked_tensors(opt):
        if per_element:
            parts = [
                (f"{what} of parameter {s.name!r}", tensor.narrow(0, s.offset, s.numel))
                for s in group.segments
            ]
        else:
            parts = [(what, tensor.reshape(-1))]
        for label, part in parts:
            part = part.double()
            values += [part.sum(), part.pow(2).sum()]
            labels += [label, label]
    device = opt.groups[0].master.device if opt.groups else torch.device("cpu")
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device), labels
    return torch.stack([v.to(device) for v in values]), labels


def check_replicas_consistent(optimizer: PartitionedOptimizer, group: ProcessGroup) -> None:
    """Check that every replica of this rank's partition holds the same optimizer state."""
    if dist.get_world_size(group) == 1:
        return
    with record_function("zero.optim.check_replicas"), torch.no_grad():
        sums, labels = _checksums(optimizer)
        both = torch.cat([sums, -sums])
        zero_comm.all_reduce(both, group, op="max")
        n = sums.numel()
        high, low = both[:n], -both[n:]
        differ = (high != low).nonzero()
        if differ.numel():
            i = int(differ[0, 0])
            ranks = list(zero_comm.group_ranks(group))
            raise ReplicaMismatchError(
                f"MiCS replicas diverged: in replicate group {ranks}, the {labels[i]} differs between "
                f"replicas (checksum from {low[i].item()!r} to {high[i].item()!r}); every replica must "
                "step with the same averaged gradients — did a rank skip a step or load other state?"
            )
