"""Parameter offload: partitioned shards kept by a ``zero_offload.ParamSwapper`` (host memory or NVMe)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zero_offload import ParamOffloadConfig, ParamSwapper, ParamTransferStats
from zero_params.state import ShardedParam, is_partitioned, state_of

__all__ = ["OffloadedShards"]


class OffloadedShards:
    """The shards of ``params`` moved into a :class:`zero_offload.ParamSwapper` (a :class:`ShardHome`)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        config: ParamOffloadConfig,
        *,
        rank: int | None = None,
        names: dict[nn.Parameter, str] | None = None,
    ) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self._keys: dict[int, str] = {}
        states: list[ShardedParam] = []
        for p in params:
            if not is_partitioned(p):
                continue
            state = state_of(p)
            if state.persistent or state.id in self._keys:
                continue
            if state.offload is not None:
                raise ValueError(f"parameter {state.display_name!r} is offloaded already")
            name = (names or {}).get(p) or state.display_name
            key = name if name not in self._keys.values() else f"{name}#{len(states)}"
            self._keys[state.id] = key
            states.append(state)
        self._states = tuple(states)
        self.swapper = ParamSwapper(
            config, [(self._keys[s.id], s.partition_numel, s.dtype) for s in states], rank=rank
        )
        with torch.no_grad():
            for s in states:
                self.swapper.store(self._keys[s.id], s.shard)
            self.swapper.flush()
            for s in states:
                s.offload = self
                s.shard = self._resting_shard(s)
        self.swapper.stats = ParamTransferStats()

    def __repr__(self) -> str:
        device = self.swapper.config.device.value
        return f"OffloadedShards({len(self._states)} shards on {device})"

    @property
    def stats(self) -> ParamTransferStats:
        """The swapper's :class:`zero_offload.ParamTransferStats`."""
        return self.swapper.stats

    @property
    def states(self) -> tuple[ShardedParam, ...]:
        """The offloaded parameters' states."""
        return self._states

    def key_of(self, state: ShardedParam) -> str:
        """The swapper key (and swap-file tensor id) of ``state``'s shard.

        Raises:
            KeyError: ``state`` is not offloaded here.
        """
        key = self._keys.get(state.id)
        if key is None:
            raise KeyError(f"parameter {state.display_name!r} is not offloaded by this OffloadedShards")
        return key

    def _resting_shard(self, state: ShardedParam) -> torch.Tensor:
        """What :attr:`ShardedParam.shard` holds between uses: the host tensor (cpu) or a placeholder."""
        if self.swapper.nvme:
            return torch.empty(0, dtype=state.dtype, device=state.device)
        key = self._keys[state.id]
        (host,) = self.swapper.fetch([key])
        self.swapper.unpin([key])
        return host

    # ------------------------------------------------------------------ ShardHome

    def upload(self, states: Sequence[ShardedParam]) -> list[torch.Tensor]:
        """The shards' values on their gather device.

        ``nvme``: swapped in (waiting for prefetched reads), copied out, unpinned — in chunks
        of at most ``buffer_count`` shards / ``max_in_cpu`` elements, each chunk's reads in
        flight together.
        """
        out: list[torch.Tensor] = []
        for chunk in self._chunks(states):
            keys = [self._keys[s.id] for s in chunk]
            views = self.swapper.fetch(keys)
            try:
                for s, v in zip(chunk, views, strict=True):
                    if self.swapper.nvme or v.device != s.device:
                        out.append(v.to(s.device, copy=True))
                    else:
                        out.append(v)
            finally:
                self.swapper.unpin(keys)
        return out

    def replace(self, state: ShardedParam, values: torch.Tensor) -> None:
        """Store new values of ``state``'s shard (written through; :meth:`flush` waits for the writes)."""
        self.swapper.store(self.key_of(state), values)

    # ------------------------------------------------------------------ training hooks

    def prefetch(self, upcoming: Iterable[tuple[nn.Parameter, bool]]) -> int:
        """Start swap-ins of offloaded shards ahead of their gather (a ``zero_coord.ShardPrefetcher``)."""
        if not self.swapper.nvme:
            return 0
        return self.swapper.prefetch(self._keys_of(upcoming))

    def _keys_of(self, upcoming: Iterable[tuple[nn.Parameter, bool]]) -> Iterator[tuple[str, bool]]:
        for p, swap_in in upcoming:
            state = getattr(p, "_zero", None)
            if isinstance(state, ShardedParam) and state.offload is self:
                yield self._keys[state.id], swap_in

    def store_all(self, items: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Store updated shard values (e.g. after an optimizer step) and wait for the writes."""
        with torch.no_grad():
            for p, values in items:
                self.replace(state_of(p), values)
            self.swapper.flush()

    def flush(self) -> None:
        """Wait for pending writes."""
        self.swapper.flush()

    def host_tensors(self) -> list[torch.Tensor]:
        """Host tensors holding shards (for memory accounting)."""
        return self.swapper.host_tensors()

    def close(self) -> None:
        """Delete the swap files; the shards cannot be read afterwards."""
        self.swapper.close()

    def _chunks(self, states: Sequence[ShardedParam]) -> Iterator[list[ShardedParam]]:
        cfg = self.swapper.config
        if not self.swapper.nvme:
            yield list(states)
            return
        chunk: list[ShardedParam] = []
        numel = 0
        for s in states:
            if chunk and (len(chunk) >= cfg.buffer_count or numel + s.partition_numel > cfg.max_in_cpu):
                yield chunk
                chunk, numel = [], 0
            chunk.append(s)
            numel += s.partition_numel
        if chunk:
            yield chunk
