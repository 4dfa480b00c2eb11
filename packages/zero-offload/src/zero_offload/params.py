"""Parameter shards in host memory or in swap files, swapped in ahead of their gather.

:class:`ParamSwapper` owns, per shard (a string key, e.g. the parameter's name), where its
values live:

* ``cpu``: one host tensor per shard, always :attr:`ShardResidence.RESIDENT`; a
  :meth:`ParamSwapper.fetch` is the (counted) transfer to the device that gathers it;
* ``nvme``: one swap file per shard (:class:`zero_offload.AsyncSwapper`: checksummed
  headers, errors naming file and tensor, space check at start-up, cleanup). A shard is in
  host memory only between its swap-in and its eviction, in one of ``buffer_count`` pool
  buffers of ``buffer_size`` elements, and never more than ``max_in_cpu`` elements at once.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar

import torch
from torch.profiler import record_function

from zero_offload.destination import OffloadDestination, OffloadTarget
from zero_offload.placement import host_memory, storage_bytes
from zero_offload.pool import BufferPool
from zero_offload.swap import AsyncSwapper, SwapHandle
from zero_offload.transfers import Transfers

__all__ = ["ParamOffloadConfig", "ParamSwapper", "ParamTransferStats", "ShardResidence"]


class ShardResidence(enum.Enum):
    """Where one offloaded shard's values are."""

    RESIDENT = "resident"
    """In host memory (``cpu``: always; ``nvme``: in a pool buffer)."""
    SWAPPING_IN = "swapping_in"
    """A swap-in into a pool buffer is in flight."""
    ON_DISK = "on_disk"
    """Only in its swap file."""


@dataclasses.dataclass(frozen=True)
class ParamOffloadConfig(OffloadDestination):
    """How parameter shards are offloaded (DeepSpeed's ``offload_param``)."""

    _WHAT: ClassVar[str] = "parameter offload"

    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    io_threads: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("buffer_count", "buffer_size", "max_in_cpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"offload_param.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class ParamTransferStats:
    """Counters of the parameter swapper: shard fetches (gathers reading a host or NVMe shard),
    stores (write-backs) and swap-ins (NVMe reads), with their bytes, and the prefetch counts."""

    fetches: Transfers = dataclasses.field(default_factory=Transfers)
    stores: Transfers = dataclasses.field(default_factory=Transfers)
    swap_ins: Transfers = dataclasses.field(default_factory=Transfers)
    prefetched: int = 0
    prefetch_hits: int = 0
    evictions: int = 0
    max_resident_elements: int = 0


class _Shard:
    """One shard's bookkeeping."""

    __slots__ = ("buffer", "dtype", "handle", "key", "numel", "pins", "prefetched", "status", "view")

    def __init__(self, key: str, numel: int, dtype: torch.dtype) -> None:
        self.key = key
        self.numel = numel
        self.dtype = dtype
        self.status = ShardResidence.ON_DISK
        self.view: torch.Tensor | None = None  # the host values while RESIDENT / SWAPPING_IN
        self.buffer: torch.Tensor | None = None  # its pool buffer (nvme)
        self.handle: SwapHandle | None = None  # in-flight read or write of the buffer
        self.pins = 0
        self.prefetched = False

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def settle(self) -> None:
        """Wait for the in-flight read or write; a finished read makes the shard RESIDENT."""
        handle = self.handle
        if handle is not None:
            self.handle = None
            handle.wait()
        if self.status is ShardResidence.SWAPPING_IN:
            self.status = ShardResidence.RESIDENT


class ParamSwapper:
    """Offloaded parameter shards: host tensors (``cpu``) or swap files, a bounded host cache (``nvme``)."""

    def __init__(
        self, config: ParamOffloadConfig, shards: Sequence[tuple[str, int, torch.dtype]], *, rank: int = 0
    ) -> None:
        self.config = config
        self.stats = ParamTransferStats()
        self._shards: dict[str, _Shard] = {}
        for key, numel, dtype in shards:
            if key in self._shards:
                raise ValueError(f"parameter swapper: shard key {key!r} is given twice")
            self._shards[key] = _Shard(key, int(numel), dtype)
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident / swapping-in shards, oldest first
        self._resident_numel = 0
        self.swapper: AsyncSwapper | None = None
        self._pool: BufferPool | None = None
        self._host: dict[str, torch.Tensor] = {}
        if config.device is OffloadTarget.NVME:
            self._check_sizes()
            itemsize = max((s.dtype.itemsize for s in self._shards.values()), default=4)
            directory = Path(config.nvme_path or ".") / f"zero_rank{rank}" / "params"
            self.swapper = AsyncSwapper(
                directory,
                required_bytes=sum(s.nbytes for s in self._shards.values()),
                tensor_count=len(self._shards),
                io_threads=config.io_threads,
            )
            self._pool = BufferPool(
                config.buffer_count, config.buffer_size * itemsize, pin_memory=config.pin_memory
            )
        else:
            memory = host_memory(config.pin_memory)
            for s in self._shards.values():
                self._host[s.key] = memory.zeros(s.numel, s.dtype)
                s.status = ShardResidence.RESIDENT
                s.view = self._host[s.key]

    def _check_sizes(self) -> None:
        c = self.config
        for s in self._shards.values():
            if s.numel > c.buffer_size or s.numel > c.max_in_cpu:
                raise ValueError(
                    f"offload_param: the shard of {s.key!r} has {s.numel} elements, more than "
                    f"buffer_size = {c.buffer_size} or max_in_cpu = {c.max_in_cpu} elements; raise "
                    "offload_param.buffer_size / max_in_cpu to at least the largest shard"
                )

    # ------------------------------------------------------------------ queries

    @property
    def nvme(self) -> bool:
        """Whether shards live in swap files."""
        return self.swapper is not None

    def keys(self) -> tuple[str, ...]:
        """Every shard key, in construction order."""
        return tuple(self._shards)

    def residence(self, key: str) -> ShardResidence:
        """Where shard ``key`` is now."""
        return self._shard(key).status

    @property
    def resident_elements(self) -> int:
        """Shard elements in host memory now (``nvme``: resident and swapping-in shards)."""
        if not self.nvme:
            return sum(s.numel for s in self._shards.values())
        return self._resident_numel

    def host_tensors(self) -> list[torch.Tensor]:
        """The host tensors holding shards (``cpu``: one per shard; ``nvme``: the pool buffers)."""
        return list(self._pool.buffers) if self._pool is not None else list(self._host.values())

    @property
    def resident_bytes(self) -> int:
        """Host bytes of :meth:`host_tensors`, counted from storages."""
        return storage_bytes(self.host_tensors())

    # ------------------------------------------------------------------ operations

    def store(self, key: str, values: torch.Tensor) -> None:
        """Give shard ``key`` new values (a tensor of its numel; copied).

        ``nvme``: copied into the shard's buffer (swapped in first if needed, evicting an
        unpinned shard) and written to its swap file asynchronously; :meth:`flush` waits.
        """
        s = self._shard(key)
        src = values.detach().reshape(-1)
        if src.numel() != s.numel:
            raise ValueError(f"parameter swapper: {s.numel} elements expected for {key!r}, got {src.numel()}")
        self.stats.stores.add(s.nbytes)
        if not self.nvme:
            self._host[key].copy_(src)
            return
        with record_function("zero.offload.param_store"):
            if s.status is ShardResidence.ON_DISK:
                self._claim(s, allow_evict_prefetched=True)
                s.status = ShardResidence.RESIDENT
            else:
                s.settle()
            view = _view(s)
            view.copy_(src)
            s.handle = self._io().write(key, view)

    def flush(self) -> None:
        """Wait for every write :meth:`store` started (re-raising the first error)."""
        for key in list(self._lru):
            s = self._shards[key]
            if s.status is ShardResidence.RESIDENT:
                s.settle()

    def prefetch(self, upcoming: Iterable[tuple[str, bool]]) -> int:
        """Start swap-ins of upcoming shards, in order of use, without blocking."""
        if not self.nvme:
            return 0
        started = 0
        wanted: set[str] = set()  # shards named earlier in this call: needed sooner, not evicted
        held = 0  # of them in memory
        with record_function("zero.offload.param_prefetch"):
            for key, swap_in in upcoming:
                s = self._shards.get(key)
                if s is None:
                    continue
                if s.status is not ShardResidence.ON_DISK or not swap_in:
                    if key not in wanted:
                        wanted.add(key)
                        held += s.status is not ShardResidence.ON_DISK
                    if held >= self.config.buffer_count:
                        break  # the cache is spoken for by shards needed sooner
                    continue
                if not self._claim(s, allow_evict_prefetched=False, block=False, keep=wanted):
                    break
                self._read(s)
                s.prefetched = True
                self.stats.prefetched += 1
                started += 1
        return started

    def fetch(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """The host values of shards ``keys`` (swapped in now unless prefetched), pinned until :meth:`unpin`.

        Raises:
            zero_offload.SwapError: a swap file is missing, truncated or corrupt (names file and shard).
            RuntimeError: ``nvme``: more shards are pinned than ``buffer_count`` / ``max_in_cpu`` allow.
        """
        shards = [self._shard(k) for k in keys]
        with record_function("zero.offload.param_fetch"):
            pinned: list[_Shard] = []
            try:
                for s in shards:
                    if s.prefetched:
                        s.prefetched = False
                        self.stats.prefetch_hits += 1
                    if s.status is ShardResidence.ON_DISK:
                        self._claim(s, allow_evict_prefetched=True)
                        self._read(s)
                    s.pins += 1  # not evictable while the others are claimed
                    pinned.append(s)
                    if s.key in self._lru:
                        self._lru.move_to_end(s.key)
                for s in shards:
                    s.settle()
            except BaseException:
                self._abort(pinned)
                raise
            out = []
            for s in shards:
                out.append(_view(s))
                self.stats.fetches.add(s.nbytes)
        return out

    def unpin(self, keys: Sequence[str]) -> None:
        """Drop one pin of each shard (an unpinned ``nvme`` shard may be evicted)."""
        for k in keys:
            s = self._shard(k)
            if s.pins <= 0:
                raise RuntimeError(f"parameter swapper: shard {k!r} unpinned more often than fetched")
            s.pins -= 1

    def evict_all(self) -> None:
        """Drop every unpinned resident shard from host memory (``nvme``; waits for writes first)."""
        for key in list(self._lru):
            s = self._shards[key]
            if s.pins == 0:
                self._evict(s)

    def close(self) -> None:
        """Delete the swap files (``nvme``); the swapper cannot be used afterwards."""
        if self.swapper is not None:
            for key in list(self._lru):
                try:
                    self._shards[key].settle()
                except Exception:  # noqa: BLE001, S110 - closing anyway
                    pass
            self.swapper.close()

    # ------------------------------------------------------------------ internals

    def _shard(self, key: str) -> _Shard:
        s = self._shards.get(key)
        if s is None:
            raise KeyError(f"parameter swapper: no shard {key!r}")
        return s

    def _io(self) -> AsyncSwapper:
        if self.swapper is None:
            raise RuntimeError("parameter swapper: swap files are used with device nvme only")
        return self.swapper

    def _buffers(self) -> BufferPool:
        if self._pool is None:
            raise RuntimeError("parameter swapper: the buffer pool exists with device nvme only")
        return self._pool

    def _read(self, s: _Shard) -> None:
        s.handle = self._io().read(s.key, _view(s))
        s.status = ShardResidence.SWAPPING_IN
        self.stats.swap_ins.add(s.nbytes)

    def _claim(
        self,
        s: _Shard,
        *,
        allow_evict_prefetched: bool,
        block: bool = True,
        keep: frozenset[str] | set[str] = frozenset(),
    ) -> bool:
        """Give ``s`` a pool buffer, evicting the least recently used evictable shard (not in ``keep``)."""
        pool = self._buffers()
        limit = self.config.max_in_cpu
        while pool.free_count == 0 or self._resident_numel + s.numel > limit:
            victim = next(
                (
                    self._shards[k]
                    for k in self._lru
                    if self._shards[k].pins == 0
                    and k not in keep
                    and (allow_evict_prefetched or not self._shards[k].prefetched)
                ),
                None,
            )
            if victim is None:
                if not block:
                    return False
                raise RuntimeError(
                    f"offload_param: no room to swap in {s.key!r} ({s.numel} elements): "
                    f"{len(self._lru)} shard(s) of {self._resident_numel} elements are held, "
                    f"buffer_count = {self.config.buffer_count}, max_in_cpu = {limit}; raise "
                    "offload_param.buffer_count / max_in_cpu to at least the shards of one module"
                )
            self._evict(victim)
        s.buffer = pool.acquire()
        s.view = s.buffer.narrow(0, 0, s.nbytes).view(s.dtype)
        self._lru[s.key] = None
        self._resident_numel += s.numel
        self.stats.max_resident_elements = max(self.stats.max_resident_elements, self._resident_numel)
        return True

    def _evict(self, s: _Shard) -> None:
        try:
            s.settle()
        finally:
            if s.buffer is not None:
                self._buffers().release(s.buffer)
            s.buffer = None
            s.view = None
            s.status = ShardResidence.ON_DISK
            s.prefetched = False
            del self._lru[s.key]
            self._resident_numel -= s.numel
            self.stats.evictions += 1

    def _abort(self, shards: Sequence[_Shard]) -> None:
        """A fetch failed: unpin what it pinned, drop its reads (their errors are already reported)."""
        for s in shards:
            s.pins -= 1
            if s.key in self._lru and s.pins == 0 and s.status is ShardResidence.SWAPPING_IN:
                try:
                    self._evict(s)
                except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                    pass


def _view(s: _Shard) -> torch.Tensor:
    if s.view is None:
        raise RuntimeError(f"parameter swapper: shard {s.key!r} is not in host memory ({s.status.name})")
    return s.view
