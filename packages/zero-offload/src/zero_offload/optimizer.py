"""Offloaded Adam / AdamW state: fp32 masters and moments in host memory or in swap files.

:class:`OffloadedOptimizer` replaces a torch ``Adam`` / ``AdamW``'s step over flat fp32
partitions ("device masters": on an accelerator the fp32 copy the model's working values come
from; on a CPU-only machine host memory as well). Each flat partition is cut into
sub-groups of at most ``sub_group_size`` elements; per sub-group a step is
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import torch
from torch.profiler import record_function

from zero_offload.cpu_adam import AdamHyper, AdamKernel, CpuAdam, adam_hyper_from_group, check_offloadable
from zero_offload.destination import OffloadDestination, OffloadTarget
from zero_offload.placement import HostMemory, HostPlacement, host_memory, storage_bytes
from zero_offload.pool import BufferPool, align_up
from zero_offload.swap import AsyncSwapper, SwapHandle
from zero_offload.transfers import Transfers

__all__ = ["OffloadedOptimizer", "OptimizerOffloadConfig", "TransferStats"]

_SLOTS = ("master", "exp_avg", "exp_avg_sq", "grad")
_SWAPPED = _SLOTS[:3]


@dataclasses.dataclass(frozen=True)
class OptimizerOffloadConfig(OffloadDestination):
    """How optimizer state is offloaded (DeepSpeed's ``offload_optimizer`` + ``sub_group_size``)."""

    _WHAT: ClassVar[str] = "optimizer offload"

    buffer_count: int = 4
    pin_memory: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    sub_group_size: int = 1_000_000_000
    io_threads: int = 2
    kernel: AdamKernel = AdamKernel.FUSED
    ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.sub_group_size < 1:
            raise ValueError(f"sub_group_size must be >= 1, got {self.sub_group_size}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"offload ratio must be within [0, 1], got {self.ratio}")
        super().__post_init__()
        if self.device is OffloadTarget.NVME:
            need = 1 + int(self.pipeline_read) + int(self.pipeline_write)
            if self.buffer_count < need:
                raise ValueError(
                    f"offload_optimizer.buffer_count = {self.buffer_count} is too small: pipeline_read="
                    f"{self.pipeline_read}, pipeline_write={self.pipeline_write} need at least {need} buffers"
                )


@dataclasses.dataclass
class TransferStats:
    """Explicit host <-> device copies of the offloaded step: gradients down and updated fp32
    masters up, one per sub-group and step."""

    grad_down: Transfers = dataclasses.field(default_factory=Transfers)
    param_up: Transfers = dataclasses.field(default_factory=Transfers)
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class _SubGroup:
    group: int
    index: int
    offset: int
    numel: int

    @property
    def name(self) -> str:
        return f"g{self.group}.s{self.index}"


class _Record:
    """One sub-group's host tensors (views) and what to do when it is committed."""

    __slots__ = ("buffer", "tensors")

    def __init__(self, tensors: dict[str, torch.Tensor], buffer: torch.Tensor | None = None) -> None:
        self.tensors = tensors
        self.buffer = buffer


class _Done:
    """A finished request (host store)."""

    def wait(self) -> None:
        return None


class _Joined:
    """Several swap handles as one; returns a pool buffer when all of them finished."""

    __slots__ = ("_handles", "_lock", "_pending", "_pool", "_buffer")

    def __init__(
        self, handles: list[SwapHandle], pool: BufferPool | None, buffer: torch.Tensor | None
    ) -> None:
        self._handles = handles
        self._pool = pool
        self._buffer = buffer
        self._lock = threading.Lock()
        self._pending = len(handles)
        for h in handles:
            h.add_done_callback(self._one_done)

    def _one_done(self, _future: object) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last and self._pool is not None and self._buffer is not None:
            self._pool.release(self._buffer)

    def wait(self) -> None:
        for h in self._handles:
            h.wait()


def _drain(handles: list[_Done | _Joined]) -> None:
    """Wait for every request, ignoring their errors (the caller is already failing)."""
    for h in handles:
        try:
            h.wait()
        except Exception:  # noqa: BLE001, S110 - the first error is the one reported
            pass


class _HostStore:
    """``cpu``: every sub-group's record lives in host tensors.

    ``aliased``: the masters and gradients given are host tensors already (a split
    :class:`HostPlacement`); the records are views of them, and only the moments are allocated.
    """

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        subgroups: Sequence[_SubGroup],
        memory: HostMemory,
        aliased: bool,
    ) -> None:
        self.aliased = aliased
        self.flat: list[dict[str, torch.Tensor]] = []
        for m in masters:
            state = {k: memory.zeros(m.numel()) for k in _SWAPPED[1:]}
            if aliased:
                state["master"] = m.detach().reshape(-1)
            else:
                state["master"] = memory.empty(m.numel()).copy_(m.detach().reshape(-1))
            self.flat.append(state)
        self.grads = [g.reshape(-1) for g in grads] if aliased else []
        biggest = max((sg.numel for sg in subgroups), default=0)
        self.grad = memory.zeros(0 if aliased else biggest)

    def fetch(self, sg: _SubGroup) -> tuple[_Record, _Done]:
        views = {k: v.narrow(0, sg.offset, sg.numel) for k, v in self.flat[sg.group].items()}
        if self.aliased:
            views["grad"] = self.grads[sg.group].narrow(0, sg.offset, sg.numel)
        else:
            views["grad"] = self.grad.narrow(0, 0, sg.numel)
        return _Record(views), _Done()

    def commit(self, sg: _SubGroup, record: _Record) -> _Done:
        return _Done()

    def tensors(self) -> list[torch.Tensor]:
        """The host tensors this store allocated (aliased masters and gradients belong to the caller)."""
        own = [t for state in self.flat for k, t in state.items() if not (self.aliased and k == "master")]
        return [*own, self.grad]


class _SwapStore:
    """``nvme``: records live in swap files, staged through a pool of aligned buffers."""

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        subgroups: Sequence[_SubGroup],
        config: OptimizerOffloadConfig,
        rank: int,
    ) -> None:
        biggest = max((sg.numel for sg in subgroups), default=0)
        self.slot_bytes = align_up(max(biggest, 1) * 4)
        total = sum(sg.numel for sg in subgroups) * 4 * len(_SWAPPED)
        directory = Path(config.nvme_path or ".") / f"zero_rank{rank}" / "optimizer"
        self.swapper = AsyncSwapper(
            directory,
            required_bytes=total,
            tensor_count=len(subgroups) * len(_SWAPPED),
            io_threads=config.io_threads,
        )
        self.pool = BufferPool(
            config.buffer_count, self.slot_bytes * len(_SLOTS), pin_memory=config.pin_memory
        )
        for sg in subgroups:  # initial records: the current masters, zero moments
            buffer = self.pool.acquire()
            record = self._views(sg, buffer)
            record.tensors["master"].copy_(
                masters[sg.group].detach().reshape(-1).narrow(0, sg.offset, sg.numel)
            )
            record.tensors["exp_avg"].zero_()
            record.tensors["exp_avg_sq"].zero_()
            self.commit(sg, record).wait()

    def _views(self, sg: _SubGroup, buffer: torch.Tensor) -> _Record:
        views = {
            k: buffer.narrow(0, i * self.slot_bytes, sg.numel * 4).view(torch.float32)
            for i, k in enumerate(_SLOTS)
        }
        return _Record(views, buffer)

    def fetch(self, sg: _SubGroup) -> tuple[_Record, _Joined]:
        buffer = self.pool.acquire()
        record = self._views(sg, buffer)
        handles = [self.swapper.read(f"{sg.name}.{k}", record.tensors[k]) for k in _SWAPPED]
        return record, _Joined(handles, None, None)

    def commit(self, sg: _SubGroup, record: _Record) -> _Joined:
        handles = [self.swapper.write(f"{sg.name}.{k}", record.tensors[k]) for k in _SWAPPED]
        return _Joined(handles, self.pool, record.buffer)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.pool.buffers)


def check_one_per_group(
    optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> None:
    """Raise ValueError unless there is one master and one gradient per optimizer param group."""
    if len(masters) != len(optimizer.param_groups) or len(grads) != len(masters):
        raise ValueError(
            f"{len(masters)} masters and {len(grads)} gradients for "
            f"{len(optimizer.param_groups)} param groups"
        )


class HostStepped(abc.ABC):
    """What the offloaded optimizers share: the torch optimizer they step for, one flat master and
    gradient per param group (checked), the offload config, where host buffers live, and the host
    bytes of their :meth:`state_tensors`.

    ``placement`` (split): ``masters`` and ``grads`` are host tensors (the flat fp32 master and
    gradient partition themselves), stepped where they are. ``rank`` names this rank's swap files.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        config: OptimizerOffloadConfig,
        *,
        rank: int = 0,
        placement: HostPlacement | None = None,
    ) -> None:
        check_one_per_group(optimizer, masters, grads)
        self.optimizer = optimizer
        self.masters = tuple(masters)
        self.grads = tuple(grads)
        self.config = config
        self.split = placement is not None and placement.split
        self._place(placement.memory if placement is not None else host_memory(config.pin_memory), rank)

    @abc.abstractmethod
    def _place(self, memory: HostMemory, rank: int) -> None:
        """Check the optimizer and config, and set up the state: host buffers from ``memory``."""

    @abc.abstractmethod
    def state_tensors(self) -> list[torch.Tensor]:
        """The host tensors this optimizer keeps (for memory accounting)."""

    @property
    def resident_state_bytes(self) -> int:
        """Host bytes holding optimizer state now, counted from storages."""
        return storage_bytes(self.state_tensors())


class OffloadedOptimizer(HostStepped):
    """Adam / AdamW steps of flat fp32 partitions with the state offloaded to host memory or NVMe."""

    def _place(self, memory: HostMemory, rank: int) -> None:
        check_offloadable(self.optimizer)
        config = self.config
        self.subgroups: tuple[_SubGroup, ...] = tuple(
            _SubGroup(gi, k, off, min(config.sub_group_size, m.numel() - off))
            for gi, m in enumerate(self.masters)
            for k, off in enumerate(range(0, m.numel(), config.sub_group_size))
        )
        self.adam = CpuAdam(config.kernel)
        self.transfers = TransferStats()
        self.step_count = 0
        self._store: _HostStore | _SwapStore
        if config.device is OffloadTarget.NVME:
            self._store = _SwapStore(self.masters, self.subgroups, config, rank)
        else:
            self._store = _HostStore(self.masters, self.grads, self.subgroups, memory, self.split)

    @property
    def swapper(self) -> AsyncSwapper | None:
        """The swapper of ``nvme`` offload (``None`` for ``cpu``)."""
        return self._store.swapper if isinstance(self._store, _SwapStore) else None

    @property
    def total_state_bytes(self) -> int:
        """Bytes of the whole offloaded state (fp32 master, ``exp_avg``, ``exp_avg_sq``)."""
        return sum(m.numel() for m in self.masters) * 4 * len(_SWAPPED)

    def state_tensors(self) -> list[torch.Tensor]:
        """The host tensors this optimizer keeps: host state, or the buffer pool (``nvme``)."""
        return self._store.tensors()

    @property
    def device_bytes_saved(self) -> int:
        """Device bytes this offload keeps off the device: the moments, and with a split placement
        the fp32 master and gradient partition too."""
        return sum(m.numel() for m in self.masters) * 4 * (4 if self.split else 2)

    def step(self, after: Callable[[int, int, int], None] | None = None) -> None:
        """One Adam step of every sub-group, in order, with reads and writes pipelined as configured.

        ``after(group, start, stop)`` is called once each sub-group's master is updated (e.g. to
        start its copy to the device while the next sub-group steps).
        """
        with record_function("zero.offload.step"), torch.no_grad():
            self.step_count += 1
            self.transfers.steps += 1
            hypers = [adam_hyper_from_group(self.optimizer, g) for g in self.optimizer.param_groups]
            ahead: deque[tuple[_Record, _Done | _Joined]] = deque()
            writes: deque[_Done | _Joined] = deque()
            n = len(self.subgroups)
            try:
                for k, sg in enumerate(self.subgroups):
                    record, reading = ahead.popleft() if ahead else self._store.fetch(sg)
                    if self.config.pipeline_read and k + 1 < n:
                        ahead.append(self._store.fetch(self.subgroups[k + 1]))
                    reading.wait()
                    self._step_one(sg, record, hypers[sg.group])
                    if after is not None:
                        after(sg.group, sg.offset, sg.offset + sg.numel)
                    writes.append(self._store.commit(sg, record))
                    while writes and (not self.config.pipeline_write or len(writes) > 1):
                        writes.popleft().wait()
                while writes:
                    writes.popleft().wait()
            except BaseException:
                _drain([h for _, h in ahead] + list(writes))  # no I/O may outlive a failed step
                raise

    def _step_one(self, sg: _SubGroup, record: _Record, hyper: AdamHyper) -> None:
        t = record.tensors
        if isinstance(self._store, _HostStore) and self._store.aliased:  # stepped where they live
            self.adam.step(t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"], self.step_count, hyper)
            return
        grad = self.grads[sg.group].narrow(0, sg.offset, sg.numel)
        # blocking copies: the host record is read by the CPU Adam right away and reused (pool)
        # right after; swap I/O of the neighbouring sub-groups overlaps them
        t["grad"].copy_(grad)
        self.transfers.grad_down.add(sg.numel * 4)
        self.adam.step(t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"], self.step_count, hyper)
        self.masters[sg.group].narrow(0, sg.offset, sg.numel).copy_(t["master"])
        self.transfers.param_up.add(sg.numel * 4)

    def export_state(self) -> list[dict[str, torch.Tensor]]:
        """Each group's state in ``torch.optim.Adam``'s format (``step``, ``exp_avg``, ``exp_avg_sq``).

        The tensors are new full-size copies (for checkpoints); empty dicts before the first step.
        """
        out: list[dict[str, torch.Tensor]] = [{} for _ in self.masters]
        if self.step_count == 0:
            return out
        for gi, m in enumerate(self.masters):
            out[gi] = {
                "step": torch.tensor(float(self.step_count)),
                "exp_avg": torch.zeros(m.numel(), dtype=torch.float32),
                "exp_avg_sq": torch.zeros(m.numel(), dtype=torch.float32),
            }
        for sg in self.subgroups:
            record, reading = self._store.fetch(sg)
            reading.wait()
            for k in ("exp_avg", "exp_avg_sq"):
                out[sg.group][k].narrow(0, sg.offset, sg.numel).copy_(record.tensors[k])
            self._release(sg, record, write=False)
        return out

    def import_state(self, state: Sequence[dict[str, torch.Tensor]]) -> None:
        """Replace the offloaded state: masters from the device masters, moments and step from ``state``.

        Args:
            state: Per group a dict in ``torch.optim.Adam``'s format (empty: no step taken yet).

        Raises:
            ValueError: group count or tensor sizes differ, or groups disagree on ``step``.
        """
        if len(state) != len(self.masters):
            raise ValueError(f"{len(state)} saved optimizer groups, this optimizer has {len(self.masters)}")
        steps = {int(float(s["step"])) if "step" in s else 0 for s in state}
        if len(steps) > 1:
            raise ValueError(f"offloaded optimizer groups must share one step count, got {sorted(steps)}")
        for gi, s in enumerate(state):
            for k in ("exp_avg", "exp_avg_sq"):
                if k in s and s[k].numel() != self.masters[gi].numel():
                    raise ValueError(
                        f"group {gi}: {k} has {s[k].numel()} elements, "
                        f"the partition {self.masters[gi].numel()}"
                    )
        with torch.no_grad():
            for sg in self.subgroups:
                record, reading = self._store.fetch(sg)
                reading.wait()
                t = record.tensors
                t["master"].copy_(self.masters[sg.group].narrow(0, sg.offset, sg.numel))
                for k in ("exp_avg", "exp_avg_sq"):
                    src = state[sg.group].get(k)
                    if src is None:
                        t[k].zero_()
                    else:
                        t[k].copy_(src.detach().reshape(-1).narrow(0, sg.offset, sg.numel))
                self._release(sg, record, write=True)
        self.step_count = steps.pop() if steps else 0

    def _release(self, sg: _SubGroup, record: _Record, *, write: bool) -> None:
        if isinstance(self._store, _SwapStore):
            if write:
                self._store.commit(sg, record).wait()
            elif record.buffer is not None:
                self._store.pool.release(record.buffer)

    def close(self) -> None:
        """Delete swap files (``nvme``); the optimizer cannot step afterwards."""
        if isinstance(self._store, _SwapStore):
            self._store.swapper.close()
