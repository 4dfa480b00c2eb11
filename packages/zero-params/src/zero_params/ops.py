"""partition / gather / release / reduce_scatter_grads / commit_shards.

Collectives are issued in the order the parameters are passed (buckets in order of first
appearance), so every rank of a group must pass the same parameters in the same order —
like any collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from zero_comm import (
    AllGatherHandle,
    AllGatherStrategy,
    ReduceScatterHandle,
    ReduceScatterStrategy,
    group_ranks,
    padded_numel,
    partition_numel,
    shard_range,
)
from zero_params.spec import ShardingSpec
from zero_params.state import (
    STATE_ATTR,
    ParamStatus,
    PartitionedParameter,
    PartitionedParameterError,
    ShardedParam,
    ShardHome,
    state_of,
)

__all__ = [
    "GatherHandle",
    "GradReduceHandle",
    "commit_shards",
    "gather",
    "invalidate_secondary",
    "partition",
    "release",
    "reduce_scatter_grads",
]

_Item = tuple[nn.Parameter, ShardedParam]
ParamsLike = nn.Module | nn.Parameter | Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]]


# ----------------------------------------------------------------------------------------
# partition
# ----------------------------------------------------------------------------------------


def partition(
    params: ParamsLike,
    group: ProcessGroup | None = None,
    *,
    persistence_threshold: int = 0,
    gather_strategy: AllGatherStrategy | None = None,
    reduce_strategy: ReduceScatterStrategy | None = None,
    secondary_strategy: AllGatherStrategy | None = None,
    remote_device: str | torch.device | None = None,
) -> list[ShardedParam]:
    """Partition parameters over ``group``: keep this rank's shard, free the rest.

    Each parameter is flattened, zero-padded to a multiple of the group size and cut into
    equal partitions; group rank ``r`` keeps partition ``r`` in its :class:`ShardedParam`
    (``param._zero``) and the parameter's storage becomes empty (its class switches to
    :class:`PartitionedParameter` until it is gathered). No communication: every rank must
    hold the same full values (same seed, or broadcast first).

    Parameters with ``numel <= persistence_threshold`` (DeepSpeed's
    ``stage3_param_persistence_threshold``) stay whole and ``AVAILABLE`` on every rank and are
    never gathered or released; their shard is a view into a padded copy of the whole
    parameter. Their gradients go through the same coalesced reduce-scatter as all others
    (:func:`reduce_scatter_grads`), so the optimizer sees one uniform kind of gradient
    partition; :func:`commit_shards` all-gathers their updated shards after a step.

    Args:
        params: A module (names come from ``named_parameters()``), parameters, or
            ``(name, parameter)`` pairs. Already partitioned parameters are returned as they are.
        group: The shard group (``None``: the world group).
        persistence_threshold: See above (a numel; 0 keeps only empty parameters whole).
        gather_strategy: All-gather strategy over ``group`` (default ``FlatAllGather(group)``).
            Parameters sharing a strategy object are gathered with one collective.
        reduce_strategy: Reduce-scatter strategy over ``group`` (default ``AllToAllReduceScatter(group)``).
        secondary_strategy: hpZ: all-gather strategy over a smaller group (e.g. over
            ``Topology.intra_node_group()``) for :func:`gather` with ``secondary=True``.
        remote_device: Where shards live (``None``: with the parameter; ``"cpu"``).

    Returns:
        The states of the given parameters, in order, duplicates removed.

    Raises:
        TypeError: an element is not an ``nn.Parameter`` (or is a parameter subclass).
        ValueError: a parameter is already partitioned over another group; invalid options.
    """
    spec = ShardingSpec.create(
        group,
        persistence_threshold=persistence_threshold,
        gather_strategy=gather_strategy,
        reduce_strategy=reduce_strategy,
        secondary_strategy=secondary_strategy,
        remote_device=remote_device,
    )
    return partition_with(spec, named_params(params))


def named_params(params: ParamsLike) -> list[tuple[str, nn.Parameter]]:
    """Normalise the accepted parameter collections to ``(name, param)`` pairs."""
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, torch.Tensor):
        return [("", params)]
    out: list[tuple[str, nn.Parameter]] = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append(item)
        else:
            out.append(("", item))
    return out


def partition_with(spec: ShardingSpec, named: Sequence[tuple[str, nn.Parameter]]) -> list[ShardedParam]:
    """:func:`partition` with a resolved :class:`ShardingSpec`."""
    out: list[ShardedParam] = []
    seen: set[int] = set()
    with record_function("zero.params.partition"), torch._C.DisableTorchFunction(), torch.no_grad():
        for name, p in named:
            if id(p) in seen:
                continue
            seen.add(id(p))
            state = getattr(p, STATE_ATTR, None)
            if isinstance(state, ShardedParam):
                if state.group_ranks != spec.group_ranks:
                    raise ValueError(
                        f"parameter {state.display_name!r} is already partitioned over ranks "
                        f"{list(state.group_ranks)}, not over {list(spec.group_ranks)}"
                    )
                if name and not state.name:
                    state.name = name
                out.append(state)
                continue
            out.append(_partition_one(spec, name, p))
    return out


def _check_param(name: str, p: Any) -> None:
    label = repr(name) if name else "<unnamed>"
    if type(p) is not nn.Parameter:
        raise TypeError(
            f"parameter {label}: zero_params partitions plain nn.Parameter objects, got {type(p).__name__}"
        )
    if p.layout != torch.strided:
        raise TypeError(
            f"parameter {label}: cannot partition a non-strided ({p.layout}) tensor; "
            "convert it to a dense (torch.strided) tensor first"
        )


def meta_target_device() -> torch.device:
    """Where a parameter built on the ``meta`` device lives once partitioned: the current
    accelerator when there is one, else the CPU."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _partition_one(spec: ShardingSpec, name: str, p: nn.Parameter) -> ShardedParam:
    """Partition one plain parameter (torch function handling disabled by the caller).

    A parameter on the ``meta`` device (built under ``torch.device("meta")``) has no values:
    its shard is allocated zero-filled on :func:`meta_target_device` (or ``remote_device``)
    and it gathers to that device; a persistent one is allocated whole (zeros). It stays
    zero until a loader fills the shards (``zero_full.from_pretrained``) or init code run
    under ``Init`` overwrites it. The full parameter is never allocated.
    """
    _check_param(name, p)
    data = p.data
    if spec.dtype is not None and data.is_floating_point() and data.dtype != spec.dtype:
        data = data.to(spec.dtype)
    size, rank = spec.group_size, spec.group_rank
    numel = data.numel()
    persistent = numel <= spec.persistence_threshold
    device = data.device
    if data.is_meta:
        device = meta_target_device()
        # a meta tensor's .data cannot be re-pointed to another device: swap in a real (empty) one
        torch.utils.swap_tensors(
            p, nn.Parameter(torch.empty(0, dtype=data.dtype, device=device), requires_grad=p.requires_grad)
        )
        if persistent:
            data = torch.zeros(data.shape, dtype=data.dtype, device=device)
    shard_device = spec.remote_device if spec.remote_device is not None else device
    if persistent:
        shard = torch.empty(0, dtype=data.dtype, device=shard_device)  # replaced below
    else:
        shard = torch.zeros(partition_numel(numel, size), dtype=data.dtype, device=shard_device)
        if not data.is_meta:
            start, stop = shard_range(numel, size, rank)
            shard[: stop - start].copy_(data.reshape(-1)[start:stop])
    state = ShardedParam(
        id=0,
        name=name,
        shape=data.shape,
        dtype=data.dtype,
        device=device,
        numel=numel,
        group=spec.group,
        group_ranks=spec.group_ranks,
        group_size=size,
        group_rank=rank,
        shard=shard,
        gather_strategy=spec.gather_strategy,
        reduce_strategy=spec.reduce_strategy,
        persistent=persistent,
        status=ParamStatus.AVAILABLE if persistent else ParamStatus.NOT_AVAILABLE,
        secondary_strategy=spec.secondary_strategy,
    )
    state.id = id(state)
    setattr(p, STATE_ATTR, state)
    if persistent:
        state.shard = _persistent_storage(p, state, data, shard_device)
    else:
        p.data = torch.empty(0, dtype=data.dtype, device=device)
        p.__class__ = PartitionedParameter
    return state


# ----------------------------------------------------------------------------------------
# state transitions (torch function handling must be disabled by the caller)
# ----------------------------------------------------------------------------------------


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
    _unsharded_dest(state, state.gather_strategy)
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
            state.shard = _persistent_storage(p, state, full, state.shard.device)
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


def _persistent_storage(
    p: nn.Parameter, state: ShardedParam, full: torch.Tensor, shard_device: torch.device
) -> torch.Tensor:
    """Re-home a persistent ``p`` into a zero-padded buffer; return its shard (a view where possible)."""
    part = state.partition_numel
    padded = torch.zeros(state.group_size * part, dtype=full.dtype, device=full.device)
    padded[: full.numel()].copy_(full.reshape(-1))
    p.data = padded[: full.numel()].view(full.shape)
    shard = padded[state.group_rank * part : (state.group_rank + 1) * part]
    return shard if shard_device == full.device else shard.to(shard_device)


def _build_secondary(state: ShardedParam, full_flat: torch.Tensor) -> None:
    """Keep this rank's partition over the secondary (hpZ) group of a freshly gathered parameter."""
    strategy = state.secondary_strategy
    if strategy is None:
        return
    part = partition_numel(state.numel, strategy.group_size)
    start, stop = shard_range(state.numel, strategy.group_size, strategy.group_rank)
    sec = state.secondary_shard
    if sec is None or sec.numel() != part or sec.dtype != state.dtype:
        sec = torch.empty(part, dtype=state.dtype, device=state.shard.device)
        state.secondary_shard = sec
    sec[: stop - start].copy_(full_flat[start:stop])
    sec[stop - start :].zero_()
    state.secondary_valid = True


# ----------------------------------------------------------------------------------------
# gather
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _GatherOp:
    """One issued all-gather for a bucket of parameters.

    ``dests`` are the tensors the gather fills, one per item: the parameters' unsharded
    storages (or, for a refresh, their current full data). ``copy_out`` is set for a
    strategy without ``all_gather_coalesced_into``: the gathered tensors then land in the
    strategy's own flat buffer and are copied into ``dests`` on ``wait()``.
    """

    comm: AllGatherHandle | None
    items: list[tuple[nn.Parameter, ShardedParam]]
    dests: list[torch.Tensor]
    copy_out: bool
    secondary: bool
    refresh: bool  # commit_shards: the full data stays where it is, only its values change

    def wait(self) -> None:
        if self.comm is None:
            return
        with record_function("zero.params.gather.wait"), torch._C.DisableTorchFunction(), torch.no_grad():
            outputs = self.comm.wait()
            if self.copy_out:
                for dest, gathered in zip(self.dests, outputs):
                    dest.view(-1).copy_(gathered[: dest.numel()])
            if not self.refresh:
                build_secondary = not self.secondary
                for p, state in self.items:
                    make_available(p, state, unsharded_view(state))
                    if build_secondary and state.secondary_strategy is not None and not state.secondary_valid:
                        _build_secondary(state, state.unsharded.flat)
        self.comm = None
        self.items = []
        self.dests = []

    def is_completed(self) -> bool:
        return self.comm is None or self.comm.is_completed()


class GatherHandle:
    """The all-gathers one :func:`gather` (or :func:`commit_shards`) call issued or joined.

    ``wait()`` completes them: the parameters become ``AVAILABLE`` views into their
    gathered buffers. Waiting twice is a no-op.
    """

    __slots__ = ("_ops",)

    def __init__(self, ops: list[_GatherOp]) -> None:
        self._ops = ops

    def __repr__(self) -> str:
        return f"GatherHandle(collectives={len(self._ops)}, completed={self.is_completed()})"

    def wait(self) -> None:
        """Block until every gather of this handle completed and the parameters are ``AVAILABLE``."""
        for op in self._ops:
            op.wait()

    def is_completed(self) -> bool:
        """Whether ``wait()`` would not block on communication."""
        return all(op.is_completed() for op in self._ops)


def _strategy_key(strategy: Any) -> Any:
    """Bucket key of a strategy: the object itself, so strategies that define value equality
    (``__eq__`` / ``__hash__``) coalesce across objects; identity otherwise."""
    try:
        hash(strategy)
    except TypeError:
        return id(strategy)
    return strategy


def _iter_states(params: Iterable[Any]) -> Iterator[tuple[nn.Parameter, ShardedParam]]:
    """Partitioned parameters with their states, each once; others are skipped."""
    if isinstance(params, torch.Tensor):
        params = [params]
    seen: set[int] = set()
    for p in params:
        state = getattr(p, STATE_ATTR, None)
        if not isinstance(state, ShardedParam) or id(p) in seen:
            continue
        seen.add(id(p))
        yield p, state


def gather(
    params: nn.Parameter | Iterable[nn.Parameter],
    *,
    async_op: bool = True,
    secondary: bool = False,
    group: ProcessGroup | None = None,
) -> GatherHandle:
    """All-gather the ``NOT_AVAILABLE`` parameters among ``params``, coalesced.

    One collective per distinct (gather strategy, dtype, device) among the parameters that
    need it. Strategies are compared with ``==`` (identity for zero_comm's strategies
    today), so partition a model with one call, one :class:`Init`, or by passing the same
    strategy objects, and every gather is a single collective. Parameters become
    ``INFLIGHT``, then on ``wait()`` ``AVAILABLE`` views (full shape) of their own
    :class:`UnshardedStorage`, which the collective fills directly (one copy per element
    out of the rank-major gathered buffer, none for a lone unpadded parameter).
    ``AVAILABLE`` (and persistent) parameters cost nothing; ``INFLIGHT`` ones join the
    existing collective (the returned handle waits for it) — no duplicate traffic.
    Non-partitioned parameters are ignored.

    With ``secondary=True`` (hpZ, e.g. for backward), parameters holding a valid
    secondary shard are gathered over their secondary group only; the others fall back to
    the primary group (and build their secondary shard). Secondary shards are built on
    every primary gather and invalidated by :func:`commit_shards` / :func:`invalidate_secondary`.

    Args:
        params: Parameters (or one parameter), the same on every rank, in the same order.
        async_op: Return before the communication completes (call ``wait()``).
        secondary: Use the hpZ secondary shards where valid.
        group: If given, every partitioned parameter must be partitioned over exactly this group.

    Returns:
        A :class:`GatherHandle` (already waited for when ``async_op=False``).

    Raises:
        ValueError: a parameter is partitioned over another group than ``group``.
    """
    with record_function("zero.params.gather"):
        want = group_ranks(group) if group is not None else None
        joined: list[_GatherOp] = []
        buckets: dict[tuple[Any, ...], tuple[AllGatherStrategy, bool, list[_Item]]] = {}
        for p, state in _iter_states(params):
            if want is not None and state.group_ranks != want:
                raise ValueError(
                    f"parameter {state.display_name!r} is partitioned over ranks {list(state.group_ranks)}, "
                    f"but gather was asked to gather over ranks {list(want)}; gather it over its own group "
                    "(omit group=) or partition it over the group you need"
                )
            if state.status is ParamStatus.AVAILABLE:
                continue
            if state.status is ParamStatus.INFLIGHT:
                if not any(op is state.handle for op in joined):
                    joined.append(state.handle)
                continue
            use_sec = secondary and state.secondary_valid and state.secondary_strategy is not None
            strategy = state.secondary_strategy if use_sec else state.gather_strategy
            key = (_strategy_key(strategy), use_sec, state.dtype, state.device)
            buckets.setdefault(key, (strategy, use_sec, []))[2].append((p, state))
        ops = [
            _issue_gather(strategy, use_sec, items, async_op) for strategy, use_sec, items in buckets.values()
        ]
        handle = GatherHandle(joined + ops)
    if not async_op:
        handle.wait()
    return handle


def _issue_gather(
    strategy: AllGatherStrategy,
    use_secondary: bool,
    items: list[tuple[nn.Parameter, ShardedParam]],
    async_op: bool,
    refresh: bool = False,
) -> _GatherOp:
    with torch._C.DisableTorchFunction():
        shards = _upload_shards(items, use_secondary)
        if refresh:
            dests = [p.data for p, _ in items]
            # a persistent parameter's shard is a view of its full data: send a copy, so the
            # collective never reads and writes the same memory
            shards = [s.clone() if state.persistent else s for s, (_, state) in zip(shards, items)]
        else:
            dests = [_unsharded_dest(state, strategy) for _, state in items]
        into = getattr(strategy, "all_gather_coalesced_into", None)
        if into is not None:
            comm = into(shards, dests, async_op=async_op)
        else:  # e.g. hierarchical or quantized: through their flat output, then one copy each
            comm = strategy.all_gather_coalesced(shards, async_op=async_op)
        op = _GatherOp(comm, items, dests, into is None, use_secondary, refresh)
        if not refresh:
            for _, state in items:
                state.status = ParamStatus.INFLIGHT
                state.handle = op
        return op


def _unsharded_dest(state: ShardedParam, strategy: AllGatherStrategy) -> torch.Tensor:
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


def _upload_shards(items: list[tuple[nn.Parameter, ShardedParam]], use_secondary: bool) -> list[torch.Tensor]:
    """The shards to all-gather, on the gather device; offloaded ones come from their home (one call each)."""
    shards: list[torch.Tensor | None] = []
    homes: dict[int, tuple[ShardHome, list[int]]] = {}
    for i, (_, state) in enumerate(items):
        if state.offload is not None and not use_secondary:
            homes.setdefault(id(state.offload), (state.offload, []))[1].append(i)
            shards.append(None)
            continue
        shard = state.secondary_shard if use_secondary else state.shard
        shards.append(shard.to(state.device, non_blocking=True) if shard.device != state.device else shard)
    for home, indices in homes.values():
        for i, t in zip(indices, home.upload([items[i][1] for i in indices]), strict=True):
            shards[i] = t
    return [s for s in shards if s is not None]


# ----------------------------------------------------------------------------------------
# release, invalidate_secondary, commit_shards
# ----------------------------------------------------------------------------------------


def release(params: nn.Parameter | Iterable[nn.Parameter]) -> None:
    """Drop the full data of gathered parameters: back to ``NOT_AVAILABLE``.

    Each parameter's unsharded storage is resized to 0 bytes: the memory is freed at once,
    also where autograd saved views of the parameter for backward (they read the storage
    again once a gather refilled it — the coordinator's backward hooks do that).
    ``INFLIGHT`` parameters are waited for first; persistent, ``NOT_AVAILABLE`` and
    non-partitioned parameters are left alone. Edits made to the full data are discarded
    (use :class:`GatheredParameters` with ``modifier_rank`` to keep them). Local, no
    communication.
    """
    with record_function("zero.params.release"), torch._C.DisableTorchFunction():
        for p, state in _iter_states(params):
            if state.persistent:
                continue
            if state.status is ParamStatus.INFLIGHT:
                state.handle.wait()
            if state.status is ParamStatus.AVAILABLE:
                make_not_available(p, state)


def invalidate_secondary(params: nn.Parameter | Iterable[nn.Parameter]) -> None:
    """Mark the hpZ secondary shards of ``params`` stale (their primary shards changed).

    The next primary gather rebuilds them; until then ``gather(..., secondary=True)`` falls
    back to the primary group. :func:`commit_shards` calls this for you.
    """
    for _, state in _iter_states(params):
        state.secondary_valid = False


def commit_shards(params: nn.Parameter | Iterable[nn.Parameter], *, async_op: bool = False) -> GatherHandle:
    """Publish shards that were updated in place (e.g. by an optimizer step).

    Invalidates hpZ secondary shards, and re-gathers the full value of every parameter
    that is whole right now — persistent parameters and any still gathered — into its
    existing storage (one coalesced all-gather per strategy; a strategy with an ``exact``
    attribute, such as the quantized ``zero_comm.QuantizedAllGather``, refreshes through that
    exact twin, so whole parameters hold exactly their shards' values). ``NOT_AVAILABLE`` parameters
    need nothing: their next gather reads the new shards.

    Args:
        params: The parameters whose shards changed, the same on every rank.
        async_op: Return before the refresh completes (call ``wait()`` before using them).

    Raises:
        PartitionedParameterError: a parameter is ``INFLIGHT`` (a gather of the old shards is
            in flight; wait for it before changing shards).
    """
    with record_function("zero.params.commit_shards"):
        buckets: dict[tuple[Any, ...], tuple[AllGatherStrategy, list[_Item]]] = {}
        for p, state in _iter_states(params):
            state.secondary_valid = False
            if state.status is ParamStatus.INFLIGHT:
                raise PartitionedParameterError(
                    f"commit_shards: parameter {state.display_name!r} is being gathered from its old shard; "
                    "wait() for the gather before updating shards"
                )
            if state.status is ParamStatus.AVAILABLE:
                # a lossy strategy (qwZ) names its exact twin: whole parameters equal their shards
                strategy = getattr(state.gather_strategy, "exact", None) or state.gather_strategy
                key = (_strategy_key(strategy), state.dtype, state.device)
                buckets.setdefault(key, (strategy, []))[1].append((p, state))
        ops = [
            _issue_gather(strategy, False, items, async_op, refresh=True)
            for strategy, items in buckets.values()
        ]
        handle = GatherHandle(ops)
    if not async_op:
        handle.wait()
    return handle


# ----------------------------------------------------------------------------------------
# reduce_scatter_grads
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _ReduceOp:
    comm: ReduceScatterHandle | None
    states: list[ShardedParam]

    def wait(self) -> None:
        if self.comm is None:
            return
        with record_function("zero.params.reduce_scatter_grads.wait"), torch._C.DisableTorchFunction():
            with torch.no_grad():
                parts = self.comm.wait()
                for state, part in zip(self.states, parts):
                    acc = state.ensure_grad_partition()
                    acc.add_(part.to(acc.device) if part.device != acc.device else part)
        self.comm = None
        self.states = []


class GradReduceHandle:
    """The reduce-scatters of one :func:`reduce_scatter_grads` call.

    ``wait()`` accumulates the averaged partitions into each parameter's gradient partition.
    """

    __slots__ = ("_ops",)

    def __init__(self, ops: list[_ReduceOp]) -> None:
        self._ops = ops

    def __repr__(self) -> str:
        return f"GradReduceHandle(collectives={len(self._ops)})"

    def wait(self) -> None:
        """Block until done; the gradient partitions then hold the accumulated averages."""
        for op in self._ops:
            op.wait()

    def is_completed(self) -> bool:
        """Whether ``wait()`` would not block on communication."""
        return all(op.comm is None or op.comm.is_completed() for op in self._ops)


def reduce_scatter_grads(
    params: nn.Parameter | Iterable[nn.Parameter], *, async_op: bool = False
) -> GradReduceHandle:
    """Average the full ``.grad`` of ``params`` over their shard groups, keep this rank's partition.

    One coalesced reduce-scatter per distinct (reduce strategy, gradient dtype, device).
    The averaged partition is *added* to :attr:`ShardedParam.grad_partition` (allocated
    zero-filled on first use, or the view an optimizer bound with
    :meth:`ShardedParam.bind_grad_partition`), so successive micro-steps accumulate; zero it
    (or the optimizer's flat buffer) after the step. Each ``.grad`` is set to ``None`` when
    the collective is issued, so a following backward starts a fresh gradient. Persistent
    parameters take part like the others. A parameter whose ``.grad`` is ``None`` (unused
    in this micro-step) contributes zeros, so every rank issues the same collective.

    Args:
        params: Partitioned parameters, the same on every rank, in the same order.
        async_op: Return before the communication completes (call ``wait()``).

    Returns:
        A :class:`GradReduceHandle` (already waited for when ``async_op=False``).

    Raises:
        TypeError: a parameter is not partitioned.
        ValueError: a ``.grad`` does not have the parameter's full number of elements.
    """
    with record_function("zero.params.reduce_scatter_grads"), torch._C.DisableTorchFunction():
        buckets: dict[tuple[Any, ...], tuple[ReduceScatterStrategy, list[torch.Tensor], list[ShardedParam]]]
        buckets = {}
        if isinstance(params, torch.Tensor):
            params = [params]
        seen: set[int] = set()
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            state = state_of(p)
            grad = p.grad
            if grad is None:
                grad = torch.zeros(state.shape, dtype=state.dtype, device=state.device)
            elif grad.numel() != state.numel:
                raise ValueError(
                    f"reduce_scatter_grads: .grad of {state.display_name!r} has {grad.numel()} elements, "
                    f"expected the full {state.numel} (shape {tuple(state.shape)}); gradients are "
                    "reduce-scattered once per micro-step, before the parameter is re-partitioned"
                )
            p.grad = None
            key = (_strategy_key(state.reduce_strategy), grad.dtype, grad.device)
            bucket = buckets.setdefault(key, (state.reduce_strategy, [], []))
            bucket[1].append(grad.contiguous())
            bucket[2].append(state)
        ops = [
            _ReduceOp(strategy.reduce_scatter_coalesced(grads, op="avg", async_op=async_op), states)
            for strategy, grads, states in buckets.values()
        ]
        handle = GradReduceHandle(ops)
    if not async_op:
        handle.wait()
    return handle
