"""ZeRO stage 3: the partitioned optimizer over ``zero_params`` shards."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import zero_coord
import zero_params
from zero_comm import BOUNDED_DTYPES, AllToAllReduceScatter, GradientBound
from zero_comm.profiling import profile_range
from zero_comm.streams import NO_STREAMS, CommStreams, NoStreams
from zero_comm.watched import collective_label, note_collectives
from zero_offload import HostPlacement, OptimizerOffloadConfig, ParamOffloadConfig
from zero_optim.buckets import BucketedReducer, BucketPlan, ReduceConfig, ReduceHandle
from zero_optim.core import PartitionedOptimizer
from zero_optim.flat import FlatGroup, GradLayout, Segment
from zero_optim.spec import OptimizerSpec

__all__ = [
    "BindingReduce",
    "PersistentRefresh",
    "RefreshPlan",
    "Stage3Partitioning",
    "offloaded_shards",
    "stage3_optimizer",
]


class Stage3Partitioning:
    """Binds ``zero_params`` shards and gradient partitions to the flat buffers (a :class:`Partitioning`)."""

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
        """The persistent parameters first, then the gathered ones, each in the group's order."""
        persistent = [p for p in params if zero_params.state_of(p).persistent]
        return persistent + [p for p in params if not zero_params.state_of(p).persistent]

    def release_grads(self, group: FlatGroup) -> bool:
        """``zero_grad`` of ``group``: the :attr:`grad_bound` restarts; its gradient partition is freed.

        A ``CHUNKS`` partition is freed and each parameter's ``grad_partition`` unbound
        (``True``): the next reduction into a parameter makes its chunk again, zeroed
        (:class:`BindingReduce`). ``False`` for a flat partition (an offloaded optimizer keeps
        the one it copies from): zero it in place.
        """
        if self.grad_bound is not None:
            self.grad_bound.reset()
        if group.grad_layout is not GradLayout.CHUNKS:
            return False
        group.release_grads()
        for seg in group.segments:
            zero_params.state_of(seg.param).unbind_grad_partition()
        return True

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
    """What :class:`PersistentRefresh` refreshes, worked out once for a set of flat groups."""

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
    """Stage 3's publish during a step: the persistent parameters' refresh travels while the rest steps."""

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
    streams: CommStreams | NoStreams = NO_STREAMS,
    placement: HostPlacement | None = None,
) -> tuple[PartitionedOptimizer, BucketedReducer]:
    """Build the ZeRO-3 optimizer of a partitioned model and its gradient sink.

    ``streams`` (``zero_comm.comm_streams``): the sink reduce-scatters on its reduce stream.
    ``placement``: where an offloaded optimizer's buffers live (see :class:`PartitionedOptimizer`).
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
        placement=placement,
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
    if offload is None:  # an offloaded optimizer keeps the flat partition it copies from
        _chunk_by_bucket(opt, plan)
    reduce_fn = zero_params.reduce_scatter_grads
    if bound_grads:
        partitioning.grad_bound = _bound_for([p for _, p in order], working_dtype)
        reduce_fn = functools.partial(zero_params.reduce_scatter_grads, bound=partitioning.grad_bound)
    return opt, BucketedReducer(plan, BindingReduce(opt, reduce_fn), config, streams)


def _chunk_by_bucket(opt: PartitionedOptimizer, plan: BucketPlan) -> None:
    """Hold each group's gradient partition in chunks: a new chunk wherever the bucket changes.

    Each chunk starts released; the parameters' ``grad_partition`` is unbound until the
    first reduction (:class:`BindingReduce`).
    """
    for group in opt.groups:
        buckets = [plan.index.get(id(seg.param)) for seg in group.segments]
        group.chunk_grads([i for i, b in enumerate(buckets) if i == 0 or b != buckets[i - 1]])
        for seg in group.segments:
            zero_params.state_of(seg.param).unbind_grad_partition()


class BindingReduce:
    """The reduce function of stage 3: binds each parameter's gradient partition, then reduces into it.

    Between optimizer steps a ``CHUNKS`` gradient partition is freed
    (:meth:`Stage3Partitioning.release_grads`); the first reduction of the next window makes
    each bucket's chunk again, zeroed, just before adding into it, so the gradient partition
    comes back one bucket at a time as backward runs (as FSDP2's sharded gradients do).
    Micro-steps of one accumulation window add into the same chunks. A reduction only
    reserves a released chunk, and fills it once the reduced partitions have arrived and the
    gradients it sent are freed (``before_add`` of ``zero_params.reduce_scatter_grads``), so
    the chunk is first written when the bucket lands, not while it is in flight.
    """

    __slots__ = ("_owners", "_reduce")

    def __init__(self, optimizer: PartitionedOptimizer, reduce_fn: Callable[..., ReduceHandle]) -> None:
        self._owners = {id(seg.param): (group, seg) for group, seg in optimizer.segments()}
        self._reduce = reduce_fn

    def __call__(self, params: Sequence[nn.Parameter], *, async_op: bool = False) -> ReduceHandle:
        """Bind the gradient partition of each of ``params`` (its chunk made if released), then reduce."""
        reserved: list[tuple[FlatGroup, Segment]] = []
        for p in params:
            owner = self._owners.get(id(p))
            if owner is None:
                continue
            group, seg = owner
            state = zero_params.state_of(p)
            if group.grad_layout is GradLayout.CHUNKS and state.grad_partition is None:
                grad = group.reserve_grad(seg)  # released (or never bound): filled when the rows land
                reserved.append(owner)
            else:
                grad = group.grad_view(seg)
            if state.grad_partition is not grad:
                state.bind_grad_partition(grad)
        if not reserved:
            return self._reduce(params, async_op=async_op)
        return self._reduce(params, async_op=async_op, before_add=functools.partial(_fill, tuple(reserved)))


def _fill(reserved: Sequence[tuple[FlatGroup, Segment]]) -> None:
    """Zero-fill the reserved chunks of ``reserved`` not filled yet (``grad_view`` fills them)."""
    for group, seg in reserved:
        group.grad_view(seg)


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
