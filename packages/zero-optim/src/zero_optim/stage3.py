"""ZeRO stage 3: the partitioned optimizer over ``zero_params`` shards.

State ownership (fp32 training):

* the optimizer's flat fp32 master of each group *is* the storage of every parameter's
  shard (``ShardedParam.shard`` is bound to a view of it): one fp32 copy of the
  parameters per rank, and the next all-gather serves the updated values directly;
* the flat fp32 gradient buffer holds every ``ShardedParam.grad_partition`` (bound views),
  which ``zero_params.reduce_scatter_grads`` accumulates into;
* the torch optimizer's state (e.g. AdamW's ``exp_avg`` / ``exp_avg_sq``) is one flat
  tensor per group, allocated by torch at the first step.

Persistent parameters (``stage3_param_persistence_threshold``) follow ``zero_params``'
semantics: whole on every rank, their gradients averaged by the same reduce-scatter, their
optimizer state partitioned like every other parameter's, and their whole value refreshed
from the updated shards after each step by ``zero_params.commit_shards``. They lie first in
the flat buffers, so a step reaches them first: :class:`PersistentRefresh` issues their
refresh as soon as they are stepped, and it travels while the optimizer steps the rest.

Parameter offload (``param_offload``, a ``zero_offload.ParamOffloadConfig``): after the
flat buffers are built, the shards of the trainable non-persistent parameters are handed to
a ``zero_params.OffloadedShards`` (host memory or swap files). The shards are then no longer
views of the working buffer but separate copies owned by the swapper, refreshed from the
working buffer after each step (:meth:`Stage3Partitioning.after_step`). The flat fp32
master stays with the optimizer (and goes to host memory or NVMe with ``offload_optimizer``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import zero_coord
import zero_params
from zero_comm import BOUNDED_DTYPES, AllToAllReduceScatter, GradientBound
from zero_comm.profiling import profile_range
from zero_comm.watchdog import collective_label, note_collectives
from zero_offload import OptimizerOffloadConfig, ParamOffloadConfig
from zero_optim.buckets import BucketedReducer, BucketPlan, ReduceConfig
from zero_optim.core import PartitionedOptimizer
from zero_optim.flat import FlatGroup, Segment
from zero_optim.spec import OptimizerSpec

__all__ = ["PersistentRefresh", "RefreshPlan", "Stage3Partitioning", "offloaded_shards", "stage3_optimizer"]


class Stage3Partitioning:
    """Binds ``zero_params`` shards and gradient partitions to the flat buffers (a :class:`Partitioning`).

    Args:
        working_dtype: The parameters' dtype, which the flat working buffer has.

    Attributes:
        grad_bound: The inf / nan check the gradient reduce-scatters carry (``None``: the step
            all-reduces a flag); set by :func:`stage3_optimizer`, restarted by :meth:`release_grads`.

    Raises:
        TypeError: from :meth:`local_numel`, for a parameter that is not partitioned.
        ValueError: from :meth:`local_numel`, for a parameter of another dtype than ``working_dtype``.
    """

    __slots__ = ("_refresh_plan", "grad_bound", "offloaded", "working_dtype")

    def __init__(self, working_dtype: torch.dtype = torch.float32) -> None:
        self.working_dtype = working_dtype
        self.grad_bound: GradientBound | None = None
        self.offloaded: zero_params.OffloadedShards | None = None
        """The offloaded shards (``param_offload``); set once the flat buffers are bound."""
        self._refresh_plan: RefreshPlan | None = None

    def local_numel(self, param: nn.Parameter) -> int:
        """The shard size (``ShardedParam.partition_numel``, padding included)."""
        state = zero_params.state_of(param)
        if state.dtype != self.working_dtype:
            raise ValueError(
                f"parameter {state.display_name!r} is {state.dtype}, but training runs in "
                f"{self.working_dtype}: cast the model (e.g. model.float()) before partitioning"
            )
        return state.partition_numel

    def flat_order(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """The persistent parameters first, then the gathered ones, each in the group's order.

        A prefetch window gathers consecutive non-persistent parameters; with the small
        persistent ones (biases, norms) elsewhere, their shards lie back to back in the flat
        buffer and the collective sends them as they lie instead of concatenating them. Laid
        out first, the persistent ones are also stepped first, and their refresh travels while
        the optimizer steps the rest (:class:`PersistentRefresh`).
        """
        persistent = [p for p in params if zero_params.state_of(p).persistent]
        return persistent + [p for p in params if not zero_params.state_of(p).persistent]

    def release_grads(self, group: FlatGroup) -> bool:
        """``zero_grad`` of ``group``: the :attr:`grad_bound` restarts; ``False``: zero the partition."""
        if self.grad_bound is not None:
            self.grad_bound.reset()
        return False

    def load(self, param: nn.Parameter, master: torch.Tensor) -> None:
        """Copy the current shard into the master view."""
        master.copy_(zero_params.state_of(param).shard)

    def bind(self, param: nn.Parameter, working: torch.Tensor, grad: torch.Tensor) -> None:
        """Make the shard a view of the working buffer and the gradient partition a view of ``grad``."""
        state = zero_params.state_of(param)
        state.bind_shard(working)
        state.bind_grad_partition(grad)

    def working_views(self, params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
        """``None``: the shards become views of the flat group's own working buffer (:meth:`bind`)."""
        return None

    def after_step(self, groups: Sequence[FlatGroup]) -> None:
        """Refresh whole (persistent) parameters from their updated shards; gathers read the shards.

        With offloaded shards, the updated working values are stored into them first.
        """
        if self.offloaded is not None:
            self.offloaded.store_all(
                (seg.param, group.working_view(seg))
                for group in groups
                for seg in group.segments
                if zero_params.state_of(seg.param).offload is self.offloaded
            )
        zero_params.commit_shards([seg.param for group in groups for seg in group.segments])

    def step_publisher(self, groups: Sequence[FlatGroup]) -> PersistentRefresh | None:
        """:meth:`after_step` done while the optimizer steps (:class:`PersistentRefresh`).

        Its :class:`RefreshPlan` is made once for the same groups, not every step. ``None``
        with offloaded shards: they are stored from the working buffer after the
        whole step (:meth:`after_step`).
        """
        if self.offloaded is not None:
            return None
        plan = self._refresh_plan
        if plan is None or not plan.covers(groups):
            plan = self._refresh_plan = RefreshPlan.of(groups)
        return PersistentRefresh(plan)

    def close(self) -> None:
        """Delete the offloaded shards' swap files (if any)."""
        if self.offloaded is not None:
            self.offloaded.close()


@dataclasses.dataclass(frozen=True)
class RefreshPlan:
    """What :class:`PersistentRefresh` refreshes, worked out once for a set of flat groups.

    Attributes:
        groups: The flat groups, in stepping order.
        ends: Per group, the flat offset where its leading persistent segments end (0: none).
        persistent: Per group, its persistent parameters.
        names: Per group, their names (for the watchdog's note).
        rest: Every other parameter of the groups (committed after the step).
    """

    groups: tuple[FlatGroup, ...]
    ends: tuple[int, ...]
    persistent: tuple[tuple[nn.Parameter, ...], ...]
    names: tuple[tuple[str, ...], ...]
    rest: tuple[nn.Parameter, ...]

    @classmethod
    def of(cls, groups: Sequence[FlatGroup]) -> RefreshPlan:
        """The plan of ``groups``: each group's leading run of persistent segments is refreshed
        during the step (:meth:`Stage3Partitioning.flat_order` puts them all there), every
        other parameter after it."""
        ends, persistent, names, rest = [], [], [], []
        for group in groups:
            lead = list(itertools.takewhile(_is_persistent, group.segments))
            ends.append(lead[-1].offset + lead[-1].numel if lead else 0)
            persistent.append(tuple(seg.param for seg in lead))
            names.append(tuple(seg.name for seg in lead))
            rest.extend(seg.param for seg in group.segments[len(lead) :])
        return cls(tuple(groups), tuple(ends), tuple(persistent), tuple(names), tuple(rest))

    def covers(self, groups: Sequence[FlatGroup]) -> bool:
        """Whether this plan was made for exactly ``groups`` (the same objects, in order)."""
        return len(groups) == len(self.groups) and all(a is b for a, b in zip(groups, self.groups))


class PersistentRefresh:
    """Stage 3's publish during a step: the persistent parameters' refresh travels while the rest is stepped.

    A ``zero_optim.publish.StepPublisher``. Each group's persistent parameters lie first in
    its flat buffers (:meth:`Stage3Partitioning.flat_order`). As soon as the optimizer has
    stepped them, their working values are published (16-bit working copies) and
    ``zero_params.commit_shards`` issues their refresh asynchronously; the optimizer steps
    the group's other shards meanwhile. :meth:`finish` commits the other parameters (which
    invalidates their hpZ secondary shards and refreshes any still gathered, synchronously)
    and waits for the refreshes. The collectives are those of :meth:`Stage3Partitioning.after_step`
    split by group and persistence; a refresh copies the shards exactly, so the parameters
    hold the same values.

    Args:
        plan: The groups' :class:`RefreshPlan` (:meth:`Stage3Partitioning.step_publisher`
            makes it once).
    """

    __slots__ = ("_handles", "_issued", "_published", "plan")

    def __init__(self, plan: RefreshPlan) -> None:
        self.plan = plan
        self._published = [0] * len(plan.groups)
        self._issued = [not params for params in plan.persistent]
        self._handles: list[zero_params.GatherHandle] = []

    @property
    def cuts(self) -> list[list[int]]:
        """Per group, where its persistent parameters end (if some are followed by others)."""
        return [
            [end] if 0 < end < group.numel else [] for end, group in zip(self.plan.ends, self.plan.groups)
        ]

    def stepped(self, group: int, stop: int) -> None:
        """Flat elements ``[0, stop)`` of ``group`` are stepped: publish them, refresh if complete."""
        with profile_range("zero.optim.publish"):
            self.plan.groups[group].publish_range(self._published[group], stop)
        self._published[group] = stop
        if not self._issued[group] and stop >= self.plan.ends[group]:
            self._issue(group)

    def _issue(self, group: int) -> None:
        self._issued[group] = True
        names = self.plan.names[group]
        note_collectives(lambda: collective_label("refreshes the persistent", names))
        self._handles.append(zero_params.commit_shards(self.plan.persistent[group], async_op=True))

    def finish(self) -> None:
        """Publish what is left, commit the other parameters and wait for every refresh."""
        with profile_range("zero.optim.publish"):
            for gi, group in enumerate(self.plan.groups):
                group.publish_range(self._published[gi], group.numel)
                self._published[gi] = group.numel
        for gi, issued in enumerate(self._issued):
            if not issued:
                self._issue(gi)
        note_collectives("refreshes the gathered parameters after the step")
        zero_params.commit_shards(self.plan.rest)
        self._wait_issued()

    def abort(self) -> None:
        """The step raised part way: wait for the refreshes already issued; issue no other."""
        self._issued = [True] * len(self._issued)
        self._wait_issued()

    def _wait_issued(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()


def _is_persistent(seg: Segment) -> bool:
    return zero_params.state_of(seg.param).persistent


def stage3_optimizer(
    model: nn.Module,
    optimizer: OptimizerSpec,
    config: ReduceConfig = ReduceConfig(),  # noqa: B008 - frozen
    *,
    working_dtype: torch.dtype = torch.float32,
    offload: OptimizerOffloadConfig | None = None,
    param_offload: ParamOffloadConfig | None = None,
    sub_group_size: int = 1_000_000_000,
    bound_grads: bool = False,
) -> tuple[PartitionedOptimizer, BucketedReducer]:
    """Build the ZeRO-3 optimizer of a partitioned model and its gradient sink.

    Args:
        model: A model whose trainable parameters are partitioned (``zero_params.partition``
            or ``zero_params.Init``).
        optimizer: A callable ``params -> torch optimizer``, a torch optimizer without state,
            or ``None`` (``torch.optim.AdamW``).
        config: Gradient bucketing policy.
        working_dtype: The parameters' dtype. ``torch.float32``: the shards are views of the
            fp32 master; a 16-bit dtype: views of a 16-bit working buffer refreshed from the
            fp32 master after each step.
        offload: Offload the optimizer state (``zero_offload.OptimizerOffloadConfig``), or ``None``.
        param_offload: Offload the parameter shards (``zero_offload.ParamOffloadConfig``), or
            ``None``; the :class:`zero_params.OffloadedShards` is then
            ``optimizer.partitioning.offloaded`` (see :func:`offloaded_shards`).
        sub_group_size: Elements of the flat partition stepped at once (bounds the step's
            temporaries; see :class:`zero_optim.PartitionedOptimizer`).
        bound_grads: Carry the inf / nan check in every gradient reduce-scatter
            (``optimizer.partitioning.grad_bound``, a ``zero_comm.GradientBound``): fp32 or
            bf16, each trained parameter reduced by a plain ``zero_comm.AllToAllReduceScatter``
            over one group whose ranks together hold every element (not MiCS).

    Gradients of parameters inside ``zero_coord`` leaf modules (mark them before calling
    this) are reduced at the end of each backward, so ranks may route data differently
    inside a leaf (see :mod:`zero_optim.buckets`).

    Returns:
        ``(optimizer, sink)``: step and zero the first; hand the second to the
        ``zero_coord.Coordinator`` as its ``grad_sink``.

    Raises:
        TypeError: a trainable parameter is not partitioned.
        ValueError: a trainable parameter is not of ``working_dtype``, the shards live on
            different devices, or ``bound_grads`` with another dtype or reduce strategy.
    """
    devices = {
        zero_params.state_of(p).shard.device for p in model.parameters() if zero_params.is_partitioned(p)
    }
    if len(devices) > 1:
        raise ValueError(f"the model's shards live on several devices {sorted(map(str, devices))}; use one")
    device = devices.pop() if devices else torch.device("cpu")
    partitioning = Stage3Partitioning(working_dtype)
    opt = PartitionedOptimizer(
        model,
        optimizer,
        partitioning,
        device=device,
        working_dtype=working_dtype,
        offload=offload,
        sub_group_size=sub_group_size,
    )
    if param_offload is not None:
        partitioning.offloaded = zero_params.OffloadedShards(
            [seg.param for _, seg in opt.segments()],
            param_offload,
            names={seg.param: seg.name for _, seg in opt.segments()},
        )
    owned = {id(seg.param) for _, seg in opt.segments()}
    order = [(n, p) for n, p in reversed(list(model.named_parameters())) if id(p) in owned]
    plan = BucketPlan(
        [p for _, p in order],
        [n for n, _ in order],
        [zero_params.state_of(p).numel for _, p in order],
        config.reduce_bucket_size,
        deferred=_leaf_params(model),
    )
    reduce_fn = zero_params.reduce_scatter_grads
    if bound_grads:
        partitioning.grad_bound = _bound_for([p for _, p in order], working_dtype)
        reduce_fn = functools.partial(zero_params.reduce_scatter_grads, bound=partitioning.grad_bound)
    return opt, BucketedReducer(plan, reduce_fn, config)


def _bound_for(params: Sequence[nn.Parameter], dtype: torch.dtype) -> GradientBound:
    """A bound for gradients of ``dtype`` reduced by one plain all-to-all reduce-scatter group size.

    Raises:
        ValueError: another dtype, or a parameter reduced another way or over another group size.
    """
    if dtype not in BOUNDED_DTYPES:
        raise ValueError(f"bound_grads needs fp32 or bf16 gradients, got {dtype}")
    sizes = set()
    for p in params:
        state = zero_params.state_of(p)
        strategy = state.reduce_strategy
        if type(strategy) is not AllToAllReduceScatter:
            raise ValueError(
                f"bound_grads: {state.display_name!r} is reduced by {type(strategy).__name__}; "
                "the bound rides only on the plain AllToAllReduceScatter"
            )
        sizes.add(strategy.group_size)
    if len(sizes) > 1:
        raise ValueError(
            f"bound_grads: the parameters are reduced over groups of {sorted(sizes)} ranks, not one"
        )
    size = sizes.pop() if sizes else 1
    if dist.is_initialized() and size != dist.get_world_size():
        raise ValueError(
            f"bound_grads: the gradients are reduced over {size} of {dist.get_world_size()} ranks "
            "(MiCS shard groups?); the bound would miss the other ranks' gradients"
        )
    return GradientBound(size)


def offloaded_shards(optimizer: PartitionedOptimizer) -> zero_params.OffloadedShards | None:
    """The offloaded shards of a :func:`stage3_optimizer` built with ``param_offload`` (else ``None``)."""
    part = optimizer.partitioning
    return part.offloaded if isinstance(part, Stage3Partitioning) else None


def _leaf_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters used inside ``zero_coord`` leaf modules (own and external ones)."""
    found: list[nn.Parameter] = []
    for leaf in zero_coord.find_leaf_modules(model).values():
        for module in leaf.modules():
            found.extend(p for p in module.parameters(recurse=False))
            found.extend(zero_params.external_parameters(module))
    return found
