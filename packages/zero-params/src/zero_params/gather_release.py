"""gather / release: all-gather partitioned parameters into their own storage, and drop it again.

Collectives are issued in the order the parameters are passed (buckets in order of first
appearance), so every rank of a group must pass the same parameters in the same order —
like any collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from zero_comm import AllGatherHandle, AllGatherStrategy, group_ranks
from zero_comm.profiling import profile_range
from zero_params.hpz import build_secondary
from zero_params.ops_handle import OpsHandle
from zero_params.selection import Item, bucket_key, iter_states
from zero_params.state import ParamStatus, ShardedParam, ShardHome, UnshardedStorage
from zero_params.transitions import make_available, make_not_available, unsharded_dest, unsharded_view

__all__ = ["GatherHandle", "GatherPlan", "gather", "issue_gather", "release"]


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
    views: list[torch.Tensor] | None = None  # full-shape views of the storages (a plan's), else made here

    def wait(self) -> None:
        if self.comm is None:
            return
        with profile_range("zero.params.gather.wait"), torch._C.DisableTorchFunction(), torch.no_grad():
            outputs = self.comm.wait()
            if self.copy_out:
                for dest, gathered in zip(self.dests, outputs):
                    dest.view(-1).copy_(gathered[: dest.numel()])
            if self.views is not None:
                for (p, state), view in zip(self.items, self.views):
                    make_available(p, state, view)
            elif not self.refresh:
                primary = not self.secondary
                for p, state in self.items:
                    make_available(p, state, unsharded_view(state))
                    if primary and state.secondary_strategy is not None and not state.secondary_valid:
                        build_secondary(state, state.unsharded.flat)
        self.comm = None
        self.items = []
        self.dests = []

    def is_completed(self) -> bool:
        return self.comm is None or self.comm.is_completed()


class GatherHandle(OpsHandle):
    """The all-gathers one :func:`gather` (or :func:`commit_shards`) call issued or joined.

    ``wait()`` completes them: the parameters become ``AVAILABLE`` views into their
    gathered buffers. Waiting twice is a no-op.
    """

    __slots__ = ()


def gather(
    params: nn.Parameter | Iterable[nn.Parameter],
    *,
    async_op: bool = True,
    secondary: bool = False,
    group: ProcessGroup | None = None,
) -> GatherHandle:
    """All-gather the ``NOT_AVAILABLE`` parameters among ``params``, coalesced."""
    with profile_range("zero.params.gather"):
        want = group_ranks(group) if group is not None else None
        joined: list[_GatherOp] = []
        buckets: dict[tuple[Any, ...], tuple[AllGatherStrategy, bool, list[Item]]] = {}
        for p, state in iter_states(params):
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
            key = (bucket_key(strategy), use_sec, state.dtype, state.device)
            buckets.setdefault(key, (strategy, use_sec, []))[2].append((p, state))
        ops = [
            issue_gather(strategy, use_sec, items, async_op) for strategy, use_sec, items in buckets.values()
        ]
        handle = GatherHandle(joined + ops)
    if not async_op:
        handle.wait()
    return handle


def issue_gather(
    strategy: AllGatherStrategy,
    use_secondary: bool,
    items: list[tuple[nn.Parameter, ShardedParam]],
    async_op: bool,
    refresh: bool = False,
) -> _GatherOp:
    with torch._C.DisableTorchFunction():
        stored = None if refresh or use_secondary else getattr(strategy, "all_gather_states", None)
        if stored is not None:  # int8-stored frozen shards (zero_params.frozen): their codes travel
            dests = [unsharded_dest(state, strategy) for _, state in items]
            comm = stored([state for _, state in items], async_op=async_op)
            return _inflight(_GatherOp(comm, items, dests, True, False, False))
        shards = _upload_shards(items, use_secondary)
        if refresh:
            dests = [p.data for p, _ in items]
            # a persistent parameter's shard is a view of its full data: send a copy, so the
            # collective never reads and writes the same memory
            shards = [s.clone() if state.persistent else s for s, (_, state) in zip(shards, items)]
        else:
            dests = [unsharded_dest(state, strategy) for _, state in items]
        into = getattr(strategy, "all_gather_coalesced_into", None)
        if into is not None:
            comm = into(shards, dests, async_op=async_op)
        else:  # e.g. hierarchical or quantized: through their flat output, then one copy each
            comm = strategy.all_gather_coalesced(shards, async_op=async_op)
        op = _GatherOp(comm, items, dests, into is None, use_secondary, refresh)
        return op if refresh else _inflight(op)


def _inflight(op: _GatherOp) -> _GatherOp:
    for _, state in op.items:
        state.status = ParamStatus.INFLIGHT
        state.handle = op
    return op


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


class GatherPlan:
    """:func:`gather` of one fixed list of parameters, planned once and issued again and again."""

    __slots__ = ("_comm", "_dests", "_items", "_keys", "_sizes", "_views", "params", "secondary")

    def __init__(self, params: Iterable[nn.Parameter], *, secondary: bool = False) -> None:
        self.params = list(params)
        self.secondary = secondary
        self._comm: Any = None  # the strategy's plan of the collective, once planned
        self._items: list[Item] = []
        self._keys: list[tuple[torch.Tensor, UnshardedStorage, torch.Tensor, AllGatherStrategy]] = []
        self._sizes: list[int] = []
        self._dests: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []

    def __repr__(self) -> str:
        return f"GatherPlan(params={len(self.params)}, planned={self._comm is not None})"

    def issue(self) -> GatherHandle:
        """Gather the parameters asynchronously; ``wait()`` the handle to make them ``AVAILABLE``."""
        if self._comm is None or not self._current():
            return self._plan()
        with profile_range("zero.params.gather"), torch._C.DisableTorchFunction():
            for (_, state), size in zip(self._items, self._sizes):
                state.unsharded.allocate(size, state.dtype, state.device)
            comm = self._comm.issue(async_op=True)
            op = _GatherOp(comm, self._items, self._dests, False, False, False, views=self._views)
            return GatherHandle([_inflight(op)])

    def _current(self) -> bool:
        """Whether every parameter is ``NOT_AVAILABLE`` and still has the shard, storage and
        strategy the plan was made with."""
        not_available = ParamStatus.NOT_AVAILABLE
        for (_, state), (shard, unsharded, flat, strategy) in zip(self._items, self._keys):
            if (
                state.status is not not_available
                or state.shard is not shard
                or state.unsharded is not unsharded
                or unsharded.flat is not flat
                or state.gather_strategy is not strategy
            ):
                return False
        return True

    def _plan(self) -> GatherHandle:
        """Plan the gather where the parameters allow it and issue it; else :func:`gather`."""
        self._comm = None
        items = list(iter_states(self.params))
        strategy = items[0][1].gather_strategy if items else None
        planner = getattr(strategy, "plan_gather_into", None)
        if planner is None or not all(_plannable(state, strategy) for _, state in items):
            return gather(self.params, async_op=True, secondary=self.secondary)
        with profile_range("zero.params.gather"), torch._C.DisableTorchFunction():
            dests = [unsharded_dest(state, strategy) for _, state in items]
            self._comm = planner([state.shard for _, state in items], dests)
            self._items = items
            self._dests = dests
            self._sizes = [dest.numel() for dest in dests]
            self._views = [unsharded_view(state) for _, state in items]
            self._keys = [
                (state.shard, state.unsharded, state.unsharded.flat, strategy) for _, state in items
            ]
        return self.issue()


def _plannable(state: ShardedParam, strategy: AllGatherStrategy) -> bool:
    """Whether a :class:`GatherPlan` can take ``state``: gathered by ``strategy`` alone, from a
    shard on the gather device, not persistent, not offloaded, without hpZ."""
    return (
        state.status is ParamStatus.NOT_AVAILABLE
        and not state.persistent
        and state.offload is None
        and state.secondary_strategy is None
        and state.gather_strategy is strategy
        and state.shard.device == state.device
        and state.shard.dtype == state.dtype
    )


def release(params: nn.Parameter | Iterable[nn.Parameter]) -> None:
    """Drop the full data of gathered parameters: back to ``NOT_AVAILABLE``."""
    with profile_range("zero.params.release"), torch._C.DisableTorchFunction():
        for p, state in iter_states(params):
            if state.persistent:
                continue
            if state.status is ParamStatus.INFLIGHT:
                state.handle.wait()
            if state.status is ParamStatus.AVAILABLE:
                make_not_available(p, state)
