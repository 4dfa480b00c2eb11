"""The partitioned-optimizer core shared by every ZeRO stage."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.profiling import profile_range
from zero_offload import (
    HostOptimizer,
    HostPlacement,
    OffloadedOptimizer,
    OptimizerOffloadConfig,
    PartialOffload,
    host_placement,
    offload_optimizer_for,
)
from zero_optim.flat import FlatGroup, Segment
from zero_optim.publish import StepPublisher
from zero_optim.spec import OptimizerSpec, build_torch_optimizer, remap_onto_flat, trainable_groups
from zero_optim.subgroups import SubGroupStepper

__all__ = ["PartitionedOptimizer", "Partitioning"]


class Partitioning(Protocol):
    """The stage-specific mapping between parameters and this rank's flat partitions."""

    def local_numel(self, param: nn.Parameter) -> int:
        """Elements of ``param`` this rank holds in the flat buffers (padding included)."""
        ...

    def load(self, param: nn.Parameter, master: torch.Tensor) -> None:
        """Copy this rank's current values of ``param`` into its 1-D fp32 ``master`` view."""
        ...

    def bind(self, param: nn.Parameter, working: torch.Tensor, grad: torch.Tensor) -> None:
        """Make ``param``'s partition storage the ``working`` view and its gradient slot ``grad``."""
        ...

    def after_step(self, groups: Sequence[FlatGroup]) -> None:
        """Make the updated partitions visible to the next forward."""
        ...

    def step_publisher(self, groups: Sequence[FlatGroup]) -> StepPublisher | None:
        """:meth:`after_step`'s work, done while the optimizer steps (a ``zero_optim.publish.StepPublisher``).

        Optional: a partitioning without this method (or returning ``None``) publishes with
        :meth:`after_step` once the whole step is done.
        """
        ...

    def flat_order(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """The order in which a group's ``params`` are laid out in its flat buffers.

        Optional: a partitioning without this method keeps the group's order. Stage 3 puts
        the persistent parameters first, so that the shards a prefetch window gathers lie
        back to back in the flat buffer and are sent as they lie, and so that the step
        reaches the persistent ones first (their refresh then travels while it steps the rest).
        """
        ...

    def working_views(
        self, params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor] | None:
        """Per parameter, the view of storage this component owns that holds this rank's working values.

        Optional: a partitioning without this method gets ``None``. ``None``: the flat group
        allocates its own working buffer. Stages 1 and 2 return this
        rank's partition of the flat buffer the whole parameters now live in, so that in fp32
        the parameters are the master copy (see :class:`zero_optim.flat.FlatGroup`).
        """
        ...

    def grad_views(
        self, params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor] | None:
        """Per parameter, the fp32 view of storage this component owns that is its gradient partition.

        Optional, as :meth:`working_views`: ``None`` (or no such method) gives the flat group
        its own flat gradient partition. Stage 1 in fp32 returns this rank's partition of the
        flat buffer the whole gradients accumulate in (reduced in place).
        """
        ...


class PartitionedOptimizer:
    """A torch optimizer stepping flat fp32 partitions of a model's parameters.

    Construction builds the user's torch optimizer over the model's parameters (keeping
    every group's options), lays out each group's trainable parameters into a
    :class:`FlatGroup`, copies the current values into the masters, binds the parameters'
    partition tensors to views of the flat buffers and re-maps the optimizer's groups onto
    the flat masters.

    With optimizer offload from an accelerator (a split :class:`zero_offload.HostPlacement`)
    the fp32 masters and gradient partitions are host buffers: the device keeps only the
    working copies, the offloaded optimizer steps the host buffers in place, and each
    updated range travels to the device while the next one steps; the device waits for
    those copies before the parameters are published.
    """

    __slots__ = ("groups", "offload", "partitioning", "placement", "stepper", "torch_optimizer")

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerSpec,
        partitioning: Partitioning,
        *,
        device: torch.device | None = None,
        working_dtype: torch.dtype = torch.float32,
        offload: OptimizerOffloadConfig | None = None,
        sub_group_size: int = 1_000_000_000,
        placement: HostPlacement | None = None,
    ) -> None:
        """``placement``: where an offloaded optimizer's buffers live (default
        :func:`zero_offload.host_placement` of ``device``; ignored without ``offload``)."""
        names = {p: n for n, p in model.named_parameters()}
        opt = build_torch_optimizer(optimizer, list(names))
        device = device if device is not None else _default_device()
        self.partitioning = partitioning
        self.placement = _placement(offload, device, placement)
        split = self.placement is not None and self.placement.split
        host = self.placement.memory if self.placement is not None and split else None
        copies = self.placement.copies if self.placement is not None and split else None
        groups = []
        with torch.no_grad():
            for ps in trainable_groups(opt, names):
                ps = _flat_order(partitioning, ps)
                views = grads = None
                if offload is None:
                    views = _optional(partitioning, "working_views", ps, working_dtype, device)
                    grads = _optional(partitioning, "grad_views", ps, working_dtype, device)
                numels = [partitioning.local_numel(p) for p in ps]
                groups.append(
                    FlatGroup(
                        ps,
                        [names[p] for p in ps],
                        numels,
                        device,
                        working_dtype,
                        working_views=views,
                        grad_views=grads,
                        host=host,
                        copies=copies,
                    )
                )
        self.groups: tuple[FlatGroup, ...] = tuple(groups)
        with torch.no_grad():
            for group in self.groups:
                if not group.master_in_params:  # else the values are in place already
                    for seg in group.segments:
                        partitioning.load(seg.param, group.master_view(seg))
                group.publish()
                for seg in group.segments:
                    partitioning.bind(seg.param, group.working_view(seg), group.grad_view(seg))
        self._join_copies()
        remap_onto_flat(opt, [g.master for g in self.groups])
        self.torch_optimizer = opt
        self.stepper = SubGroupStepper(opt, self.groups, sub_group_size)
        self.offload: OffloadedOptimizer | HostOptimizer | PartialOffload | None = None
        if offload is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            masters = [g.master for g in self.groups]
            grads = [g.grad for g in self.groups]
            self.offload = offload_optimizer_for(
                opt, masters, grads, offload, rank=rank, placement=self.placement
            )

    @property
    def offloaded_device_bytes(self) -> int:
        """Device bytes the optimizer offload keeps off the device (0 without offload): the
        optimizer state, and with a split placement the fp32 masters and gradient partitions."""
        return self.offload.device_bytes_saved if self.offload is not None else 0

    def _join_copies(self) -> None:
        """The compute stream waits for the host -> device copies of a split placement."""
        if self.placement is not None and self.placement.split:
            self.placement.copies.join()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's group dicts (change ``lr`` here, or through an LR scheduler)."""
        return self.torch_optimizer.param_groups

    def segments(self) -> Iterator[tuple[FlatGroup, Segment]]:
        """Every trainable parameter's segment with its group, in group then parameter order."""
        for group in self.groups:
            for seg in group.segments:
                yield group, seg

    def step(self) -> None:
        """One optimizer step over the flat partitions, then publish the updated values."""
        with profile_range("zero.optim.step"), torch.no_grad():
            before = getattr(self.partitioning, "before_step", None)
            if before is not None:
                before()
            publish = self._step_publisher()
            if publish is not None:
                try:
                    self.stepper.step(cuts=publish.cuts, after=publish.stepped)
                except BaseException:
                    publish.abort()  # nothing issued is left in flight behind the exception
                    raise
                publish.finish()
                return
            if self.offload is not None and self.placement is not None and self.placement.split:
                groups = self.groups
                self.placement.copies.settle()  # the last step's copies read the host masters
                self.offload.step(after=lambda gi, start, stop: groups[gi].publish_range(start, stop))
                self._join_copies()
                with profile_range("zero.optim.publish"), torch.no_grad():
                    self.partitioning.after_step(self.groups)
                return
            if self.offload is not None:
                self.offload.step()
            else:
                self.stepper.step()
            self.publish_updated_shards()

    def _step_publisher(self) -> StepPublisher | None:
        """The partitioning's optional ``step_publisher(groups)``; ``None`` with offload (the
        offloaded step publishes afterwards) or without one."""
        publisher = getattr(self.partitioning, "step_publisher", None)
        if self.offload is not None or publisher is None:
            return None
        return publisher(self.groups)

    def publish_updated_shards(self) -> None:
        """Make the parameters show the fp32 masters: after a step, or after masters were loaded.

        Copies each group's masters into its working (bf16 / fp16 / fp32) partitions, then runs
        :meth:`Partitioning.after_step` (stage 3 commits the shards, stages 1 / 2 gather the
        whole parameters). Collective under stages 1 / 2: call it on every rank.
        """
        with profile_range("zero.optim.publish"), torch.no_grad():
            for group in self.groups:
                group.publish()
            self._join_copies()
            self.partitioning.after_step(self.groups)

    def zero_grad(self) -> None:
        """Zero the flat gradient partitions in place (views into them stay valid).

        A partitioning with a ``release_grads(group)`` returning ``True`` (stage 1's in-place
        gradients) releases that group's gradients instead of zeroing them: the next
        reduction overwrites them, and :meth:`step` zeroes any it did not (``before_step``).
        """
        release = getattr(self.partitioning, "release_grads", None)
        with profile_range("zero.optim.zero_grad"):
            for group in self.groups:
                if release is None or not release(group):
                    group.zero_grad()

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this optimizer owns: flat masters, gradients, working copies, optimizer state."""
        for group in self.groups:
            yield from group.owned_tensors()
        for state in self.torch_optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value
        if self.offload is not None:
            yield from self.offload.state_tensors()

    @contextlib.contextmanager
    def materialized_state(self, *, write_back: bool = True) -> Iterator[None]:
        """Inside the block, offloaded state is in ``torch_optimizer.state`` in torch's own format."""
        if self.offload is None:
            yield
            return
        masters = [g.master for g in self.groups]
        for master, state in zip(masters, self.offload.export_state()):
            if state:
                self.torch_optimizer.state[master] = state
        try:
            yield
            if write_back:
                self.offload.import_state([dict(self.torch_optimizer.state.get(m, {})) for m in masters])
        finally:
            self.torch_optimizer.state.clear()

    def close(self) -> None:
        """Release offload resources (delete swap files); the optimizer cannot step afterwards."""
        if self.offload is not None:
            self.offload.close()
        closer = getattr(self.partitioning, "close", None)
        if callable(closer):  # e.g. stage 3's offloaded parameter shards
            closer()

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state: layout, flat masters and the torch optimizer's state.

        The tensors are the live buffers (not copies); save or clone them before stepping again
        (with offload, the optimizer state is a copy read back from the offloaded store; when
        the fp32 master lives in the parameters, ``master`` is a flat copy of it).
        """
        with self.materialized_state(write_back=False):
            return {
                "layout": [[(s.name, s.numel) for s in g.segments] for g in self.groups],
                "master": [g.master_copy() for g in self.groups],
                "torch_optimizer": self.torch_optimizer.state_dict(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same layout (masters are copied in place).

        Ends with :meth:`Partitioning.after_step`, which may communicate: call it on every rank.

        Raises:
            ValueError: the saved layout (group count, parameter names or partition sizes)
                differs from this optimizer's; the message names the first difference.
        """
        mine = [[(s.name, s.numel) for s in g.segments] for g in self.groups]
        saved = [[tuple(x) for x in g] for g in state["layout"]]
        if saved != mine:
            raise ValueError(f"optimizer state layout differs: {_first_difference(saved, mine)}")
        with torch.no_grad(), self.materialized_state():
            for group, master in zip(self.groups, state["master"]):
                group.load_master(master)
            self.torch_optimizer.load_state_dict(state["torch_optimizer"])
        self.stepper.forget_state_views()  # the loaded state replaced the tensors they view
        self._join_copies()
        self.partitioning.after_step(self.groups)


def _first_difference(saved: list[list[tuple[Any, ...]]], mine: list[list[tuple[Any, ...]]]) -> str:
    if len(saved) != len(mine):
        return f"{len(saved)} saved param groups, this optimizer has {len(mine)}"
    for gi, (a, b) in enumerate(zip(saved, mine)):
        for i in range(max(len(a), len(b))):
            x = a[i] if i < len(a) else None
            y = b[i] if i < len(b) else None
            if x != y:
                return f"group {gi}, entry {i}: saved (name, numel) {x}, here {y}"
    return "unknown"


def _optional(
    partitioning: Partitioning,
    name: str,
    params: Sequence[nn.Parameter],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor] | None:
    """``partitioning.working_views`` / ``grad_views``; ``None`` for a partitioning without it."""
    method = getattr(partitioning, name, None)
    return method(params, dtype, device) if callable(method) else None


def _flat_order(partitioning: Partitioning, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """``partitioning.flat_order(params)``, checked to be a reordering; ``params`` without that method."""
    method = getattr(partitioning, "flat_order", None)
    if not callable(method):
        return params
    ordered = list(method(params))
    if sorted(map(id, ordered)) != sorted(map(id, params)):
        name = type(partitioning).__name__
        raise RuntimeError(f"{name}.flat_order must return the same parameters, reordered")
    return ordered


def _placement(
    offload: OptimizerOffloadConfig | None, device: torch.device, placement: HostPlacement | None
) -> HostPlacement | None:
    """The offload's placement; never split for partial offload (its device part steps there)."""
    if offload is None:
        return None
    chosen = placement if placement is not None else host_placement(device, offload.pin_memory)
    if chosen.split and offload.ratio < 1.0:
        return dataclasses.replace(chosen, split=False)
    return chosen


def _default_device() -> torch.device:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc if acc is not None else torch.device("cpu")
