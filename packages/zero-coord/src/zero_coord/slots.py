"""Slot and batch bookkeeping: one slot per managed parameter, and which slots are live."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

import zero_params
from zero_comm.streams import NO_STREAMS, CommStreams, NoStreams
from zero_comm.watched import collective_label, note_collectives
from zero_coord.stats import StatsAccumulator

__all__ = ["MAX_PLANS", "GatherBatch", "LiveSlots", "ParamSlot", "SlotTable"]

MAX_PLANS = 4096
"""Most gather plans one :class:`LiveSlots` keeps (a few per trace event in practice)."""


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class GatherBatch:
    """The parameters one gather call made live, until the gather was waited for.

    Each parameter has its own unsharded storage (``zero_params.UnshardedStorage``), so
    releasing one frees its bytes at once; the live-element accounting counts per
    parameter accordingly. ``event``: the gather stream's event the compute stream waits
    on before the gathered parameters are used (``None`` without side streams).
    """

    handle: Any
    numel: int
    live: int
    streams: CommStreams | NoStreams = NO_STREAMS
    event: Any = None

    def wait(self) -> None:
        """Wait for the gather (once): the compute stream after the gather stream's event, then
        the collective (its copy-out runs on the compute stream)."""
        handle = self.handle
        if handle is not None:
            self.handle = None
            self.streams.wait(self.event)
            self.event = None
            handle.wait()


@dataclasses.dataclass(eq=False, slots=True)
class ParamSlot:
    """Per-parameter state of the coordinator (nothing is stored on the parameter itself)."""

    param: nn.Parameter
    name: str
    index: int
    numel: int
    nbytes: int
    hpz: bool = False
    holds: int = dataclasses.field(default=0, init=False)
    batch: GatherBatch | None = dataclasses.field(default=None, init=False)
    prefetched: bool = dataclasses.field(default=False, init=False)
    retained: bool = dataclasses.field(default=False, init=False)
    grad_ready: bool = dataclasses.field(default=False, init=False)
    release_on_grad: bool = dataclasses.field(default=False, init=False)

    def __repr__(self) -> str:
        return (
            f"ParamSlot({self.name!r}, numel={self.numel}, holds={self.holds}, live={self.batch is not None})"
        )


class SlotTable:
    """The managed parameters of one installed model, each with its :class:`ParamSlot`.

    Args:
        param_names: Qualified name of each parameter of the model (first name of a tied one).
    """

    __slots__ = ("param_names", "slot_of", "slots")

    def __init__(self, param_names: dict[nn.Parameter, str]) -> None:
        self.param_names = param_names
        self.slots: list[ParamSlot] = []
        self.slot_of: dict[nn.Parameter, ParamSlot] = {}

    @classmethod
    def for_model(cls, model: nn.Module) -> SlotTable:
        """An empty table that names parameters after ``model.named_parameters()``."""
        names: dict[nn.Parameter, str] = {}
        for name, param in model.named_parameters():
            names.setdefault(param, name)
        return cls(names)

    def module_slots(self, module: nn.Module, name: str, leaf: bool) -> tuple[ParamSlot, ...]:
        """Slots ``module`` needs: its direct and external parameters (a leaf: its whole subtree's)."""
        params: list[nn.Parameter] = []
        owners = module.modules() if leaf else (module,)
        for owner in owners:
            params.extend(p for p in owner._parameters.values() if p is not None)
            params.extend(zero_params.external_parameters(owner))
        slots: dict[ParamSlot, None] = {}
        for param in params:
            slot = self._slot(param, name)
            if slot is not None:
                slots[slot] = None
        return tuple(slots)

    def _slot(self, param: nn.Parameter, module_name: str) -> ParamSlot | None:
        slot = self.slot_of.get(param)
        if slot is not None:
            return slot
        if not zero_params.is_partitioned(param):
            return None
        state = zero_params.state_of(param)
        name = self.param_names.get(param) or state.name or f"{module_name}.<external parameter>"
        if not state.name:
            state.name = name  # lets zero_params' errors name it
        if state.persistent:
            return None
        numel = state.numel
        hpz = state.secondary_strategy is not None
        slot = ParamSlot(param, name, len(self.slots), numel, numel * param.element_size(), hpz)
        self.slots.append(slot)
        self.slot_of[param] = slot
        return slot


class LiveSlots:
    """Which slots are live (gathered or in flight) and in which role, with element counts.

    Gathers are issued through ``streams`` (on the gather stream when there is one).
    """

    __slots__ = (
        "acc",
        "ahead",
        "ahead_numel",
        "grad_ready",
        "live",
        "live_slots",
        "pending_grad_numel",
        "plans",
        "retained",
        "streams",
    )

    def __init__(self, acc: StatsAccumulator, streams: CommStreams | NoStreams = NO_STREAMS) -> None:
        self.acc = acc
        self.streams = streams
        self.plans: dict[tuple[Any, ...], zero_params.GatherPlan] = {}
        self.live = 0
        self.live_slots: dict[ParamSlot, None] = {}
        self.ahead: dict[ParamSlot, None] = {}
        self.ahead_numel = 0
        self.retained: dict[ParamSlot, None] = {}
        self.pending_grad_numel = 0
        self.grad_ready: list[ParamSlot] = []

    @property
    def bounded_live(self) -> int:
        """Live elements that count against ``max_live_parameters`` for prefetching: all gathered
        ones except those waiting only for their gradient (autograd holds them)."""
        return self.live - self.pending_grad_numel

    def gather(self, slots: list[ParamSlot], secondary: bool, numel: int | None = None) -> GatherBatch:
        """Issue one coalesced async gather for ``slots`` (none of them live).

        ``secondary`` (backward uses): parameters with a valid hpZ secondary shard are gathered
        over their secondary (e.g. intra-node) group; the others over their own group.
        ``numel``: their elements, when the caller knows them (from the trace plan).
        """
        note_collectives(lambda: collective_label("gathers", [s.name for s in slots]))
        key = (*slots, secondary)
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= MAX_PLANS:
                self.plans.clear()  # windows of orders no longer run: plan the current ones afresh
            plan = self.plans[key] = zero_params.GatherPlan([s.param for s in slots], secondary=secondary)
        streams = self.streams
        handle, event = streams.gather(plan.issue)
        nbytes = 0
        for s in slots:
            nbytes += s.nbytes
        if numel is None:
            numel = sum(s.numel for s in slots)
        batch = GatherBatch(handle, numel, len(slots), streams, event)
        live_slots = self.live_slots
        for s in slots:
            s.batch = batch
            live_slots[s] = None
        self.live += numel
        acc = self.acc
        acc.gathers += 1
        acc.bytes_gathered += nbytes
        if self.live > acc.max_live_elements:
            acc.max_live_elements = self.live
        return batch

    def claim(self, slot: ParamSlot) -> bool:
        """``slot`` (live) is used again or freed: drop its kept / prefetched role.

        Returns whether it was prefetched (a prefetch hit when a module uses it).
        """
        if slot.retained:
            slot.retained = False
            del self.retained[slot]
        if slot.prefetched:
            slot.prefetched = False
            del self.ahead[slot]
            self.ahead_numel -= slot.numel
            return True
        return False

    def mark_prefetched(self, slots: list[ParamSlot], numel: int) -> None:
        """``slots`` (live, unheld; ``numel`` elements) wait for their next use, which prefetching covers."""
        ahead = self.ahead
        for s in slots:
            s.prefetched = True
            ahead[s] = None
        self.ahead_numel += numel

    def mark_retained(self, slot: ParamSlot) -> None:
        """``slot`` (live, unheld) stays gathered for a near reuse."""
        slot.retained = True
        self.retained[slot] = None

    def set_release_on_grad(self, slot: ParamSlot, flag: bool) -> None:
        """Whether ``slot``'s gradient hook releases it (its module's backward is done)."""
        if slot.release_on_grad != flag:
            slot.release_on_grad = flag
            self.pending_grad_numel += slot.numel if flag else -slot.numel

    def note_grad_ready(self, slot: ParamSlot) -> None:
        """``slot``'s gradient was accumulated in this backward."""
        if not slot.grad_ready:
            slot.grad_ready = True
            self.grad_ready.append(slot)

    def free(self, slots: list[ParamSlot]) -> None:
        """Release gathered parameters (waiting for their gather first if still in flight)."""
        for s in slots:
            if s.batch.handle is not None:
                s.batch.wait()
        zero_params.release([s.param for s in slots])
        live_slots = self.live_slots
        for s in slots:
            batch = s.batch
            s.batch = None
            del live_slots[s]
            batch.live -= 1
            self.live -= s.numel  # its own storage was emptied: the bytes are gone now
            if s.retained or s.prefetched:
                self.claim(s)
            if s.release_on_grad:
                self.set_release_on_grad(s, False)

    def drop_prefetched(self) -> None:
        """Free parameters prefetched for a trace that no longer holds."""
        dropped = [s for s in self.ahead if s.holds == 0]
        for s in self.ahead:
            s.prefetched = False
        self.ahead.clear()
        self.ahead_numel = 0
        if dropped:
            self.free(dropped)

    def free_all(self, force: bool) -> None:
        """Free every live parameter (``force``: dropping every hold) or every unheld one;
        forget this backward's ready gradients."""
        if force:
            free = list(self.live_slots)
            for s in free:
                s.holds = 0
                self.set_release_on_grad(s, False)
        else:
            free = [s for s in self.live_slots if s.holds == 0]
        if free:
            self.free(free)
        for s in self.grad_ready:
            s.grad_ready = False
        self.grad_ready = []
