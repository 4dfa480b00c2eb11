"""``GatheredParameters``: whole parameters inside a ``with`` block."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
from torch import nn
from torch.profiler import record_function

from zero_comm import broadcast
from zero_params.external import (
    external_parameters,
    register_external_parameter,
    unregister_external_parameter,
)
from zero_params.gather_release import gather, release
from zero_params.state import STATE_ATTR, ParamStatus, ShardedParam
from zero_params.transitions import reshard_from_full

__all__ = ["GatheredParameters"]


class GatheredParameters:
    """Make partitioned parameters whole for the duration of a ``with`` block.

    On entry, the ``NOT_AVAILABLE`` parameters are all-gathered (one coalesced collective
    per group) and ``INFLIGHT`` ones waited for; on exit, exactly the ``NOT_AVAILABLE`` ones
    are released again — parameters that were already whole or being gathered by someone
    else (e.g. a prefetch), and persistent ones, stay as they were.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        plist = [params] if isinstance(params, torch.Tensor) else list(params)
        seen: set[int] = set()
        self.params = [p for p in plist if not (id(p) in seen or seen.add(id(p)))]
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self._gathered: list[nn.Parameter] = []
        self._registered: list[nn.Parameter] = []
        self._snapshots: list[tuple[nn.Parameter, torch.Tensor]] = []

    def _partitioned(self) -> list[tuple[nn.Parameter, ShardedParam]]:
        out = []
        for p in self.params:
            state = getattr(p, STATE_ATTR, None)
            if isinstance(state, ShardedParam):
                out.append((p, state))
        return out

    def _check_modifier_rank(self, items: list[tuple[nn.Parameter, ShardedParam]]) -> None:
        r = self.modifier_rank
        if r is None or not items:
            return
        groups = {state.group_ranks for _, state in items}
        if len(groups) > 1:
            raise ValueError(
                f"GatheredParameters(modifier_rank={r}): the parameters are partitioned over different "
                f"groups {sorted(groups)}; modifier_rank is a rank within one group — use one block per group"
            )
        size = items[0][1].group_size
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < size:
            raise ValueError(
                f"GatheredParameters: modifier_rank={r!r} is out of range for a shard group of size {size}; "
                f"use a group rank in [0, {size - 1}] or None to discard edits"
            )

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        items = self._partitioned()
        self._check_modifier_rank(items)
        with record_function("zero.params.gathered_parameters.enter"):
            # INFLIGHT parameters belong to whoever issued their gather (e.g. a prefetch)
            self._gathered = [p for p, state in items if state.status is ParamStatus.NOT_AVAILABLE]
            if self.modifier_rank is None:
                with torch._C.DisableTorchFunction():
                    self._snapshots = [(p, p.data.clone()) for p, state in items if state.persistent]
            gather([p for p, _ in items], async_op=False)
        if self.fwd_module is not None:
            already = {id(p) for p in external_parameters(self.fwd_module)}
            for p in self.params:
                if id(p) not in already:
                    register_external_parameter(self.fwd_module, p)
                    self._registered.append(p)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.enabled:
            return
        try:
            if exc_type is None and self.modifier_rank is not None:
                self._broadcast_edits(self._partitioned())
        finally:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                for p, saved in self._snapshots:
                    p.data.copy_(saved)
            self._snapshots = []
            release(self._gathered)
            self._gathered = []
            for p in self._registered:
                unregister_external_parameter(self.fwd_module, p)
            self._registered = []

    def _broadcast_edits(self, items: list[tuple[nn.Parameter, ShardedParam]]) -> None:
        """Broadcast the modifier rank's full values and re-partition them on every rank."""
        if not items:
            return
        src = items[0][1].group_ranks[self.modifier_rank]
        buckets: dict[tuple[torch.dtype, torch.device], list[tuple[nn.Parameter, ShardedParam]]] = {}
        for p, state in items:
            buckets.setdefault((state.dtype, state.device), []).append((p, state))
        with record_function("zero.params.gathered_parameters.broadcast"), torch._C.DisableTorchFunction():
            with torch.no_grad():
                for (dtype, device), bucket in buckets.items():
                    datas = [p.data.reshape(-1) for p, _ in bucket]
                    flat = torch.cat(datas) if datas else torch.empty(0, dtype=dtype, device=device)
                    broadcast(flat, src, items[0][1].group)
                    offset = 0
                    for p, state in bucket:
                        n = state.numel
                        p.data.copy_(flat[offset : offset + n].view_as(p.data))
                        offset += n
                        reshard_from_full(p, state)
