"""ZeRO stages 0, 1 and 2 on the partitioned-optimizer core: whole parameters, partitioned state.

Parameters stay whole (``param.data`` untouched) on every rank. Each trainable parameter
is flattened and padded to a multiple of the partition world size; this rank owns
partition ``r`` of it — exactly the :class:`~zero_optim.flat.Segment` of stage 3, so every
stage splits each parameter, its optimizer state and its checkpoint pieces alike at a given
world size (stage 3 only orders its persistent parameters first in the flat buffers:
:meth:`~zero_optim.Stage3Partitioning.flat_order`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

import zero_comm
from zero_comm.adjacent_runs import add_in_runs as _add_in_runs
from zero_comm.adjacent_runs import in_fewer_runs as _in_fewer_runs
from zero_comm.coalesced import GatherIntoPlan, adjacent_flat_view
from zero_comm.grad_bound import BOUNDED_DTYPES, GradientBound
from zero_comm.profiling import profile_range
from zero_comm.watched import note_collectives
from zero_offload import HostPlacement, OptimizerOffloadConfig
from zero_optim.buckets import BucketedReducer, BucketPlan, ReduceConfig, ReduceHandle
from zero_optim.core import PartitionedOptimizer
from zero_optim.flat import FlatGroup
from zero_optim.in_place_grads import InPlaceGrads
from zero_optim.publish import GatherBucket, PipelinedPublish, gather_buckets
from zero_optim.reductions import BackwardReduction, BoundaryReduction, GradientReduction, HookedReduction
from zero_optim.spec import OptimizerSpec

__all__ = [
    "AllReduceInto",
    "ReduceScatterInPlace",
    "ReduceScatterInto",
    "ReplicaPartitioning",
    "replicated_optimizer",
]


def _world_and_rank(group: ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class ReplicaPartitioning:
    """Whole parameters on every rank, this rank owning partition ``rank`` of each (a ``Partitioning``)."""

    __slots__ = (
        "_bound",
        "_gather_plan",
        "_gather_routes",
        "_grads",
        "_regions",
        "allgather_bucket_size",
        "grad_bound",
        "grads_in_place",
        "group",
        "rank",
        "world",
    )

    def __init__(
        self,
        world: int,
        rank: int,
        group: ProcessGroup | None = None,
        *,
        allgather_bucket_size: int = 500_000_000,
        grads_in_place: bool = False,
        bound_grads: bool = False,
    ) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"ReplicaPartitioning: rank {rank} is not in [0, {world})")
        if allgather_bucket_size < 1:
            raise ValueError(f"allgather_bucket_size must be >= 1, got {allgather_bucket_size}")
        self.world = world
        self.rank = rank
        self.group = group
        self.allgather_bucket_size = allgather_bucket_size
        self.grads_in_place = grads_in_place
        self._bound: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._gather_plan: tuple[tuple[FlatGroup, ...], tuple[GatherBucket, ...]] | None = None
        self._gather_routes: dict[int, tuple[tuple[int, ...], GatherIntoPlan]] = {}
        self._grads = InPlaceGrads(world, rank)
        self._regions: dict[int, torch.Tensor] = {}
        self.grad_bound = GradientBound(world) if bound_grads else None

    def local_numel(self, param: nn.Parameter) -> int:
        """``ceil(numel / world)``: this rank's partition, padding included."""
        return zero_comm.partition_numel(param.numel(), self.world)

    def load(self, param: nn.Parameter, master: torch.Tensor) -> None:
        """Copy elements ``[rank * P, (rank + 1) * P)`` of the flattened parameter (zero padding)."""
        flat = param.detach().reshape(-1)
        start = min(self.rank * master.numel(), flat.numel())
        n = min(master.numel(), flat.numel() - start)
        master.zero_()
        master[:n].copy_(flat[start : start + n])

    def working_views(
        self, params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor] | None:
        """Move the whole parameters into one flat buffer; return this rank's partition of each."""
        if self.world == 1:
            return None
        sizes = [self.local_numel(p) for p in params]
        full = torch.zeros(sum(sizes) * self.world, dtype=dtype, device=device)
        views: list[torch.Tensor] = []
        offset = 0
        for p, size in zip(params, sizes, strict=True):
            region = full.narrow(0, offset, size * self.world)
            region[: p.numel()].copy_(p.detach().reshape(-1))
            p.data = region[: p.numel()].view(p.shape)
            self._regions[id(p)] = region
            views.append(region.narrow(0, self.rank * size, size))
            offset += size * self.world
        return views

    def grad_views(
        self, params: Sequence[nn.Parameter], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor] | None:
        """With ``grads_in_place`` in fp32: whole gradients in one flat buffer; this rank's partitions."""
        if not self.grads_in_place or self.world == 1 or dtype != torch.float32:
            return None
        return self._grads.allocate(params, [self.local_numel(p) for p in params], device)

    @property
    def grads(self) -> InPlaceGrads:
        """The in-place whole gradients (empty unless :meth:`grad_views` allocated some)."""
        return self._grads

    def release_grads(self, group: FlatGroup) -> bool:
        """``zero_grad`` of ``group``: release its in-place gradients (nothing is written).

        ``False`` if the group has none (its partition is then zeroed as usual). Either way the
        :attr:`grad_bound` restarts.

        Every parameter of a group is in place or none is (:meth:`grad_views` is per group).
        """
        if self.grad_bound is not None:
            self.grad_bound.reset()
        if not group.segments or group.segments[0].param not in self._grads:
            return False
        self._grads.release([seg.param for seg in group.segments])
        return True

    def before_step(self) -> None:
        """Zero the gradient partitions no reduction wrote since they were released."""
        self._grads.zero_released()

    def bind(self, param: nn.Parameter, working: torch.Tensor, grad: torch.Tensor) -> None:
        """Remember the parameter's working and gradient-partition views (the parameter stays whole).

        In a one-rank partition world (stage 0) the partition is the whole parameter: the
        parameter's storage becomes the working view itself (in fp32 the master: one fp32
        copy of the parameters, as in DDP), so a step needs no copy back.
        """
        self._bound[id(param)] = (working, grad)
        if self.world == 1:
            param.data = working.view(param.shape)

    @property
    def in_place_grads(self) -> bool:
        """Whether :meth:`grad_views` bound the gradients of the parameters to a flat buffer."""
        return bool(self._grads)

    def owns(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is trained by the optimizer this partitioning was bound by."""
        return id(param) in self._bound

    def grad_partition(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 gradient-partition view bound to ``param``.

        Raises:
            KeyError: ``param`` is not trained by this optimizer.
        """
        return self._bound[id(param)][1]

    def after_step(self, groups: Sequence[FlatGroup]) -> None:
        """All-gather the updated working partitions into the whole parameters, bucket by bucket.

        Parameters living in the flat buffer of :meth:`working_views` receive their whole padded
        region (padding included), so each bucket's gathered rows reach the parameters with one
        fused copy instead of one strided copy per parameter.
        """
        with profile_range("zero.optim.allgather_params"), torch.no_grad():
            for bucket in self._buckets(groups):
                self._gather(bucket)

    def step_publisher(self, groups: Sequence[FlatGroup]) -> PipelinedPublish | None:
        """The gathers of :meth:`after_step`, each issued as soon as the step has updated its bucket.

        ``None`` in a one-rank partition world (stage 0), where publishing is a local copy.
        """
        if self.world == 1:
            return None
        return PipelinedPublish(groups, self._buckets(groups), self._issue)

    def _buckets(self, groups: Sequence[FlatGroup]) -> tuple[GatherBucket, ...]:
        """:func:`gather_buckets` of ``groups``, computed once for the same groups (not every step)."""
        plan = self._gather_plan
        if plan is None or len(plan[0]) != len(groups) or any(a is not b for a, b in zip(plan[0], groups)):
            buckets = tuple(gather_buckets(groups, self.world, self.allgather_bucket_size))
            plan = self._gather_plan = (tuple(groups), buckets)
            self._gather_routes.clear()  # keyed by the buckets replaced
        return plan[1]

    def _issue(self, bucket: GatherBucket) -> zero_comm.AllGatherHandle:
        """Gather ``bucket`` straight from the collective's buffer into the parameters (one copy).

        The bucket's :class:`~zero_comm.coalesced.GatherIntoPlan` (checks, route, views) is made
        once and reused while its destinations are the ones it was made for.
        """
        dests = [self._gather_dest(param) for param, _ in bucket.items]
        where = tuple(d.data_ptr() for d in dests)
        found = self._gather_routes.get(id(bucket))
        if found is None or found[0] != where:
            found = self._gather_routes[id(bucket)] = (
                where,
                GatherIntoPlan([s for _, s in bucket.items], dests, self.group),
            )
        note_collectives(lambda: f"gathers the updated parameters ({len(bucket.items)} from the step)")
        return found[1].issue(async_op=True)

    def _gather(self, bucket: GatherBucket) -> None:
        if self.world == 1:
            for param, shard in bucket.items:
                if param.data_ptr() != shard.data_ptr():  # bound views need no copy
                    param.data.view(-1).copy_(shard[: param.numel()])
            return
        self._issue(bucket).wait()

    def _gather_dest(self, param: nn.Parameter) -> torch.Tensor:
        """The padded region ``param`` lives in, or its own data once moved out of it."""
        region = self._regions.get(id(param))
        data = param.data
        if region is None or data.data_ptr() != region.data_ptr() or not data.is_contiguous():
            return data
        return region


class _AccumulateHandle:
    """Waits for a collective, then adds its per-parameter results into the gradient partitions."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            with torch.no_grad():
                finish()


def _finish_now_or_later(finish: Callable[[], None], async_op: bool) -> _AccumulateHandle:
    """The handle running ``finish`` on ``wait()``, already waited on unless ``async_op``."""
    out = _AccumulateHandle(finish)
    if not async_op:
        out.wait()
    return out


def _take_grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """The full gradients (zeros for unused parameters), detached from the parameters."""
    grads = []
    for p in params:
        g = p.grad
        grads.append(torch.zeros_like(p) if g is None else g.contiguous())
        p.grad = None
    return grads


@dataclasses.dataclass(frozen=True)
class _ReplicaReduce:
    """A ``reduce_fn`` over a :class:`ReplicaPartitioning`, with an optional reduce-scatter strategy.

    Attributes:
        partitioning: Where each parameter's fp32 gradient partition lives.
        strategy: The reduce-scatter over the partitioning's group (``None``: the plain one;
            e.g. ``zero_comm.CastReduceScatter``).

    Raises:
        ValueError: both a strategy and the partitioning's bound are set (only the plain
            reduce-scatter carries the bound's sideband; a strategy's reductions would leave it
            incomplete).
    """

    partitioning: ReplicaPartitioning
    strategy: zero_comm.ReduceScatterStrategy | None = None

    def __post_init__(self) -> None:
        if self.partitioning.grad_bound is not None and self.strategy is not None:
            raise ValueError(
                "a partitioning built with bound_grads needs the plain reduce-scatter: a strategy does not "
                "carry the sideband, so the bound would miss its gradients"
            )


@dataclasses.dataclass(frozen=True)
class ReduceScatterInto(_ReplicaReduce):
    """``reduce_fn`` of stages 1 and 2: average full gradients, add this rank's partition (coalesced).

    Attributes:
        partitioning: Where each parameter's fp32 gradient partition lives.
        strategy: The reduce-scatter over the partitioning's group (``None``: the plain
            ``zero_comm.reduce_scatter_coalesced``; e.g. ``zero_comm.CastReduceScatter``).
    """

    def __call__(self, params: Sequence[nn.Parameter], *, async_op: bool = False) -> ReduceHandle:
        """Reduce-scatter the ``.grad`` of ``params`` (``None`` = zeros) and free them."""
        with profile_range("zero.optim.reduce_scatter_grads"):
            params, targets, runs = _in_fewer_runs(params, self.partitioning)
            grads = _take_grads(params)
            handle = self._reduce.reduce_scatter_coalesced(grads, op="avg", async_op=True)
            return _finish_now_or_later(lambda: _add_in_runs(targets, handle.wait(), runs), async_op)

    @functools.cached_property
    def _reduce(self) -> zero_comm.ReduceScatterStrategy:
        """The reduce-scatter of every call, chosen once: :attr:`strategy`, else the plain one
        (carrying the partitioning's bound, if it has one)."""
        if self.strategy is not None:
            return self.strategy
        plain = zero_comm.AllToAllReduceScatter(self.partitioning.group)
        bound = self.partitioning.grad_bound
        return plain if bound is None else bound.riding(plain)

    def open_bucket(self, params: Sequence[nn.Parameter]) -> _StagedBucket | None:
        """A staging buffer for one bucket, filled as each gradient arrives (``None``: a strategy is set)."""
        if self.strategy is not None or not params:
            return None
        if len(params) == 1 and params[0].numel() % self.partitioning.world == 0:
            return None
        params, targets, runs = _in_fewer_runs(params, self.partitioning)
        first, bound = params[0], self.partitioning.grad_bound
        numels = [p.numel() for p in params] + ([bound.world] if bound is not None else [])
        staging = zero_comm.StagedReduceScatter(numels, self.partitioning.group, first.dtype, first.device)
        return _StagedBucket(tuple(params), staging, targets, runs, bound)


class _StagedBucket:
    """One bucket of :meth:`ReduceScatterInto.open_bucket`: gradients staged on arrival, then reduced.

    With a bound, the staging holds one more tensor after the gradients: their sideband,
    computed from the staged rows at :meth:`issue`.
    """

    __slots__ = ("_bound", "_index", "_params", "_runs", "_staging", "_targets")

    def __init__(
        self,
        params: tuple[nn.Parameter, ...],
        staging: zero_comm.StagedReduceScatter,
        targets: list[torch.Tensor],
        runs: list[tuple[int, int]],
        bound: GradientBound | None = None,
    ) -> None:
        self._bound = bound
        self._params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._staging = staging
        self._targets = targets
        self._runs = runs

    def put(self, param: nn.Parameter) -> None:
        """Copy ``param.grad`` into the staging buffer and free it."""
        with profile_range("zero.optim.stage_grad"):
            self._staging.put(self._index[id(param)], param.grad)
            param.grad = None

    def issue(self, *, async_op: bool = False) -> ReduceHandle:
        """Reduce-scatter the bucket (gradients never put count as zeros) into the gradient partitions."""
        with profile_range("zero.optim.reduce_scatter_grads"):
            for p in self._params:  # a gradient that arrived without its hook (none normally)
                if p.grad is not None:
                    self.put(p)
            bound, staging = self._bound, self._staging
            if bound is not None:  # the staging's last slot is the sideband's
                handle = bound.issue_staged(staging, len(self._params), op="avg")
            else:
                handle = staging.issue(op="avg", async_op=True)
            targets, runs = self._targets, self._runs
            return _finish_now_or_later(lambda: _add_in_runs(targets, handle.wait(), runs), async_op)


@dataclasses.dataclass(frozen=True)
class ReduceScatterInPlace(_ReplicaReduce):
    """``reduce_fn`` of stage 1 with in-place gradients: average whole gradients into their own partition."""

    def __call__(self, params: Sequence[nn.Parameter], *, async_op: bool = False) -> ReduceHandle:
        """Reduce-scatter the whole gradients of ``params`` into their own partitions."""
        with profile_range("zero.optim.reduce_scatter_grads"):
            part, grads = self.partitioning, self.partitioning.grads
            live = [r for r in (grads.region(p) for p in params) if r.numel()]
            if not live:
                grads.reduced(params)
                return _AccumulateHandle(lambda: None)
            if self.strategy is None:  # the reduced rows land in the regions themselves
                bound = part.grad_bound
                if bound is not None:
                    in_place = bound.reduce_in_place(live, part.group, op="avg")
                else:
                    in_place = zero_comm.reduce_scatter_in_place(live, part.group, op="avg", async_op=True)

                def finish() -> None:
                    in_place.wait()
                    grads.reduced(params)

            else:
                handle = self.strategy.reduce_scatter_coalesced(live, op="avg", async_op=True)

                def finish() -> None:
                    _keep_own_partition(live, handle.wait(), part.rank)
                    grads.reduced(params)

            return _finish_now_or_later(finish, async_op)

    def before_accumulate(self, param: nn.Parameter) -> None:
        """Before autograd adds to ``param.grad`` (see ``InPlaceGrads.before_accumulate``)."""
        self.partitioning.grads.before_accumulate(param)

    def accumulated(self, param: nn.Parameter) -> None:
        """After autograd accumulated ``param``'s gradient: the window's first is copied in and bound."""
        self.partitioning.grads.region(param)

    def carry(self, param: nn.Parameter) -> None:
        """Before more gradient accumulates on a reduced region in the same window.

        See :meth:`~zero_optim.in_place_grads.InPlaceGrads.carry`.
        """
        self.partitioning.grads.carry(param)


def _keep_own_partition(regions: Sequence[torch.Tensor], reduced: Sequence[torch.Tensor], rank: int) -> None:
    """Copy each reduced partition into its place in the region (this rank's row).

    One fused copy for the whole bucket (``split_with_sizes_copy``) instead of one per
    parameter. A reduced partition that lies inside a region itself (a lone unpadded tensor
    of the first or last rank is reduced in place) is copied element-wise.
    """
    mine = [
        region.narrow(0, rank * part.numel(), part.numel())
        for region, part in zip(regions, reduced, strict=True)
    ]
    source = adjacent_flat_view(reduced)
    inside = any(r.untyped_storage().data_ptr() == reduced[0].untyped_storage().data_ptr() for r in regions)
    if source is None or inside:
        for dest, part in zip(mine, reduced, strict=True):
            dest.copy_(part)
    else:
        torch.split_with_sizes_copy(source, [m.numel() for m in mine], out=mine)


@dataclasses.dataclass(frozen=True)
class AllReduceInto:
    """``reduce_fn`` of stage 0: average full gradients with one all-reduce per bucket, add them whole."""

    partitioning: ReplicaPartitioning
    group: ProcessGroup | None = None
    strategy: zero_comm.CastAllReduce | None = None

    def __call__(self, params: Sequence[nn.Parameter], *, async_op: bool = False) -> ReduceHandle:
        """All-reduce (average) the ``.grad`` of ``params`` (``None`` = zeros) and free them."""
        with profile_range("zero.optim.all_reduce_grads"):
            grads = _take_grads(params)
            flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
            wide = self.strategy is not None and self.strategy.reduce.dtype.itemsize > flat.dtype.itemsize
            if wide:  # e.g. bf16 gradients summed in fp32 and added unrounded to the fp32 partitions
                flat = flat.to(self.strategy.reduce.dtype)
                handle = zero_comm.all_reduce(flat, self.group, op="avg", async_op=True)
            elif self.strategy is not None:
                handle = self.strategy.all_reduce(flat, op="avg")
            else:
                handle = zero_comm.all_reduce(flat, self.group, op="avg", async_op=True)
            targets = [self.partitioning.grad_partition(p) for p in params]

            def finish() -> None:
                done = handle.wait()
                for target, part in zip(targets, done.split([t.numel() for t in targets]), strict=True):
                    target.add_(part)

            return _finish_now_or_later(finish, async_op)


def replicated_optimizer(
    model: nn.Module,
    optimizer: OptimizerSpec,
    stage: int,
    config: ReduceConfig = ReduceConfig(),  # noqa: B008 - frozen
    *,
    allgather_bucket_size: int = 500_000_000,
    working_dtype: torch.dtype = torch.float32,
    group: ProcessGroup | None = None,
    offload: OptimizerOffloadConfig | None = None,
    sub_group_size: int = 1_000_000_000,
    reduce_strategy: zero_comm.ReduceScatterStrategy | None = None,
    all_reduce_strategy: zero_comm.CastAllReduce | None = None,
    streams: zero_comm.CommStreams | zero_comm.NoStreams = zero_comm.NO_STREAMS,
    placement: HostPlacement | None = None,
) -> tuple[PartitionedOptimizer, GradientReduction]:
    """Build the optimizer and gradient reduction of ZeRO stage 0, 1 or 2 for a whole model.

    ``streams`` (``zero_comm.comm_streams``): every stage reduces on its reduce stream.
    ``placement``: where an offloaded optimizer's buffers live (see :class:`PartitionedOptimizer`).
    """
    if stage not in (0, 1, 2):
        raise ValueError(
            f"replicated_optimizer builds stages 0, 1 and 2, got stage {stage}; use stage3_optimizer"
        )
    for n, p in model.named_parameters():
        if p.requires_grad and p.dtype != working_dtype:
            raise ValueError(
                f"parameter {n!r} is {p.dtype}, but training runs in {working_dtype}: cast the model first"
            )
    world, rank = _world_and_rank(group)
    part = (
        ReplicaPartitioning(1, 0, allgather_bucket_size=allgather_bucket_size)
        if stage == 0
        else ReplicaPartitioning(
            world,
            rank,
            group,
            allgather_bucket_size=allgather_bucket_size,
            grads_in_place=stage == 1 and offload is None,
            bound_grads=reduce_strategy is None and working_dtype in BOUNDED_DTYPES,
        )
    )
    devices = {p.device for p in model.parameters()}
    device = devices.pop() if len(devices) == 1 else None
    opt = PartitionedOptimizer(
        model,
        optimizer,
        part,
        device=device,
        working_dtype=working_dtype,
        offload=offload,
        sub_group_size=sub_group_size,
        placement=placement,
    )
    order = [(n, p) for n, p in reversed(list(model.named_parameters())) if part.owns(p)]
    plan = BucketPlan(
        [p for _, p in order], [n for n, _ in order], [p.numel() for _, p in order], config.reduce_bucket_size
    )
    params = [p for _, p in order]
    if stage == 0:
        reduce = AllReduceInto(part, group, all_reduce_strategy)
        return opt, BoundaryReduction(plan, reduce, config.max_inflight, streams)
    strategy = reduce_strategy
    if stage == 1:
        reduce_fn = (
            ReduceScatterInPlace(part, strategy) if part.in_place_grads else ReduceScatterInto(part, strategy)
        )
        return opt, BackwardReduction(params, plan, reduce_fn, config.max_inflight, streams)
    reducer = BucketedReducer(plan, ReduceScatterInto(part, strategy), config, streams)
    return opt, HookedReduction(params, reducer)
