"""The coordinator: which partitioned parameters are gathered when, and when they are freed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

import zero_params
from zero_comm.profiling import profile_range
from zero_comm.streams import NO_STREAMS, CommStreams, NoStreams
from zero_comm.watched import path_diverged, recording_paths
from zero_coord._tree import collect_grad_tensors
from zero_coord.config import CoordinatorConfig, Phase
from zero_coord.error_hints import annotate_unseen_parameter
from zero_coord.fetch import Fetcher
from zero_coord.hooks import GradHook, HookSet, ModuleHookState
from zero_coord.leaf import coordinated_leaves
from zero_coord.prefetch_source import ShardPrefetcher
from zero_coord.release import Releaser
from zero_coord.sink import GradientSink
from zero_coord.slots import LiveSlots, ParamSlot, SlotTable
from zero_coord.stats import StatsAccumulator, StepStats
from zero_coord.step import StepState
from zero_coord.trace import Trace

__all__ = ["Coordinator"]

logger = logging.getLogger("zero.coord")


class Coordinator:
    """Gathers, prefetches and releases the partitioned parameters of ``model`` around its modules.

    ``streams`` (``zero_comm.comm_streams``): gathers and prefetches run on its gather
    stream and a module waits on the gather's event before using its parameters;
    ``NO_STREAMS`` (the default, and on CPU) orders nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        config: CoordinatorConfig = CoordinatorConfig(),  # noqa: B008 - frozen, immutable default
        grad_sink: GradientSink | None = None,
        shard_prefetch: ShardPrefetcher | None = None,
        streams: CommStreams | NoStreams = NO_STREAMS,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Coordinator(model=...) needs an nn.Module, got {type(model).__name__}")
        if not isinstance(config, CoordinatorConfig):
            raise TypeError(f"Coordinator(config=...) needs a CoordinatorConfig, got {type(config).__name__}")
        if grad_sink is not None and not isinstance(grad_sink, GradientSink):
            raise TypeError(
                f"grad_sink {type(grad_sink).__name__} lacks on_grad_ready(param) / on_backward_end()"
            )
        self._model = model
        self._config = config
        if shard_prefetch is not None and not isinstance(shard_prefetch, ShardPrefetcher):
            raise TypeError(f"shard_prefetch {type(shard_prefetch).__name__} lacks prefetch(params)")
        if not isinstance(streams, (CommStreams, NoStreams)):
            raise TypeError(
                f"Coordinator(streams=...) needs zero_comm.comm_streams(...), got {type(streams).__name__}"
            )
        self._sink = grad_sink
        self._hooks = HookSet()
        self._installed = False
        self._paused = False
        self._states: list[ModuleHookState] = []
        self._state_of: dict[nn.Module, ModuleHookState] = {}
        self._manual_states: dict[nn.Module, ModuleHookState] = {}
        self._table = SlotTable({})
        self._module_slots: list[tuple[ParamSlot, ...]] = []
        self._names: list[str] = []
        self._traces: dict[tuple[Phase, int], Trace] = {}
        self._step: StepState | None = None
        self._frozen: list[nn.Parameter] = []
        self._callback_queued = False
        self._acc = StatsAccumulator()
        self._last = StepStats()
        self._total = StepStats()
        self._live = LiveSlots(self._acc, streams)
        self._releaser = Releaser(config, self._live)
        self._fetcher = Fetcher(config, self._live, self._releaser, shard_prefetch)
        # Active from a step's root pre-forward to its post-forward: a saved view of a released
        # parameter read by backward raises a PartitionedParameterError naming it.
        self._guard = zero_params.SavedTensorGuard(
            lambda: [zero_params.state_of(s.param) for s in self._table.slots]
        )

    def __repr__(self) -> str:
        return (
            f"Coordinator({type(self._model).__name__}, installed={self._installed}, "
            f"hooked_modules={len(self._states)}, params={len(self._table.slots)})"
        )

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> CoordinatorConfig:
        """The policy this coordinator runs with."""
        return self._config

    @property
    def installed(self) -> bool:
        """Whether the hooks are installed."""
        return self._installed

    @property
    def hooked_modules(self) -> tuple[str, ...]:
        """Qualified names of the modules that got hooks (root first)."""
        return tuple(self._names)

    @property
    def last_step_stats(self) -> StepStats:
        """Statistics of the last finished step (empty before the first)."""
        return self._last

    @property
    def live_elements(self) -> int:
        """Parameter elements currently gathered or in flight through this coordinator."""
        return self._live.live

    @property
    def total_stats(self) -> StepStats:
        """Running total over every finished step since construction."""
        return self._total

    def install(self) -> None:
        """Install every hook: forward pre/post hooks on the modules that need parameters (and
        on the root), pre-/post-backward nodes through them, post-accumulate-grad hooks on the
        partitioned parameters; the final backward callback is queued per backward.
        """
        if self._installed:
            raise RuntimeError("Coordinator.install(): hooks are already installed; call remove() first")
        self._build()
        try:
            self._register_hooks()
        except BaseException:
            self._hooks.remove()
            raise
        self._installed = True

    def remove(self) -> None:
        """Release every gathered parameter and remove every hook this coordinator installed."""
        if self._installed:
            self.release_all()
        self._hooks.remove()
        self._installed = False
        self._reset_structure()

    def _reset_structure(self) -> None:
        """Forget everything :meth:`install` derived from the model."""
        self._states = []
        self._state_of = {}
        self._manual_states = {}
        self._table = SlotTable({})
        self._frozen = []
        self._module_slots = []
        self._names = []
        self._traces = {}
        self._step = None
        self._live.plans.clear()

    @property
    def paused(self) -> bool:
        """Whether the hooks are paused (see :meth:`pause`)."""
        return self._paused

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Suspend the hooks without removing them: inside the block forwards gather and
        release nothing (parameters must be gathered by the caller, e.g. with
        ``zero_params.gather``; a forward reaching one that is not raises
        ``zero_params.PartitionedParameterError``). Every parameter the coordinator holds is
        released on entry; traces are kept. For inference: no backward may run inside.
        """
        self.release_all()
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def fetch(self, module: nn.Module) -> None:
        """Gather ``module``'s parameters now and hold them until :meth:`release`.

        Covers its direct and external parameters (its whole subtree for a leaf module).
        Manual fetches are not recorded in traces.
        """
        ms = self._manual_state(module)
        if ms.slots:
            with profile_range("zero.coord.fetch"):
                self._fetcher.acquire(ms)

    def release(self, module: nn.Module) -> None:
        """Drop one hold of ``module``'s parameters taken by :meth:`fetch`; free them when unheld."""
        ms = self._manual_state(module)
        if ms.slots:
            with profile_range("zero.coord.release"):
                self._releaser.release_module(ms, self._step, backward=False)

    def release_all(self) -> None:
        """Free every gathered and in-flight parameter and abandon the step in progress.

        For recovery after an exception or before work outside the model (checkpointing).
        A complete trace stays complete; a recording one records again on the next step.
        """
        with profile_range("zero.coord.release"):
            if self._step is not None:
                self._close_step(finished=False)
            else:
                self._release_everything(force=True)

    def trace(self, phase: Phase) -> Trace:
        """The trace of ``phase`` for steps started by the model's own forward.

        Raises:
            RuntimeError: the hooks are not installed.
        """
        self._require_installed("trace")
        return self._trace_for(phase, self._states[0])

    def traces(self) -> dict[tuple[Phase, str], Trace]:
        """Every trace, keyed by phase and the qualified name of the module that starts the step."""
        return {(phase, self._names[index]): trace for (phase, index), trace in self._traces.items()}

    def invalidate_traces(self) -> None:
        """Drop every trace silently; the next step of each phase records again."""
        for trace in self._traces.values():
            trace.invalidate(None)
        step = self._step
        if step is not None and (step.valid or step.recording):
            step.valid = False
            step.recording = False
            self._live.drop_prefetched()

    # ------------------------------------------------------------------ construction

    def _require_installed(self, what: str) -> None:
        if not self._installed:
            raise RuntimeError(f"Coordinator.{what}(): call install() first")

    def _build(self) -> None:
        self._reset_structure()
        model = self._model
        self._table = SlotTable.for_model(model)
        leaves = coordinated_leaves(model, self._config.module_granularity_threshold)
        leaf_modules = set(leaves.values())
        inside_leaf: set[nn.Module] = set()
        for leaf in leaves.values():
            inside_leaf.update(sub for sub in leaf.modules() if sub is not leaf)
        for name, module in model.named_modules():
            if module in inside_leaf:
                continue
            slots = self._table.module_slots(module, name, leaf=module in leaf_modules)
            if slots or module is model:
                self._add_state(module, name, slots, module in leaf_modules)
        # Windows split between forward and backward only where backward gathers over hpZ groups.
        self._fetcher.hpz = any(s.hpz for s in self._table.slots)

    @property
    def leaf_modules(self) -> tuple[str, ...]:
        """Qualified names of the modules gathered as one leaf (marked or by granularity), once
        installed."""
        return tuple(ms.name for ms in self._states if ms.is_leaf)

    def _add_state(self, module: nn.Module, name: str, slots: tuple[ParamSlot, ...], leaf: bool) -> None:
        ms = ModuleHookState(self, module, name, len(self._states), slots, leaf)
        self._states.append(ms)
        self._state_of[module] = ms
        self._module_slots.append(slots)
        self._names.append(name)

    def _register_hooks(self) -> None:
        hooks = self._hooks
        for ms in self._states:
            hooks.add(ms.module.register_forward_pre_hook(ms.pre_forward, prepend=True, with_kwargs=True))
            hooks.add(ms.module.register_forward_hook(ms.post_forward, always_call=True))
        seen: set[nn.Parameter] = set()
        self._frozen = []
        for param in list(self._model.parameters()) + [s.param for s in self._table.slots]:
            if param in seen or not zero_params.is_partitioned(param):
                continue
            seen.add(param)
            if param.requires_grad:
                self._add_grad_hook(param)
            else:
                self._frozen.append(param)

    def _add_grad_hook(self, param: nn.Parameter) -> None:
        hook = GradHook(self, self._table.slot_of.get(param))
        self._hooks.add(param.register_post_accumulate_grad_hook(hook.on_grad_accumulated))

    def _hook_unfrozen(self) -> None:
        """Give parameters unfrozen since install (``requires_grad_(True)``) their gradient hook."""
        unfrozen = [p for p in self._frozen if p.requires_grad]
        if unfrozen:
            self._frozen = [p for p in self._frozen if not p.requires_grad]
            for param in unfrozen:
                self._add_grad_hook(param)

    def _manual_state(self, module: nn.Module) -> ModuleHookState:
        self._require_installed("fetch/release")
        ms = self._state_of.get(module) or self._manual_states.get(module)
        if ms is not None:
            return ms
        for name, candidate in self._model.named_modules():
            if candidate is module:
                ms = ModuleHookState(
                    self, module, name, -1, self._table.module_slots(module, name, leaf=False), False
                )
                self._manual_states[module] = ms
                return ms
        raise ValueError(
            f"{type(module).__name__} is not a submodule of the coordinated {type(self._model).__name__}"
        )

    # ------------------------------------------------------------------ hook entry points

    def on_pre_forward(self, ms: ModuleHookState, recompute: bool) -> None:
        """Pre-forward of a hooked module (``recompute``: run inside a backward, e.g. checkpointing)."""
        if recompute:
            if ms.slots:
                with profile_range("zero.coord.fetch"):
                    self._fetcher.acquire(ms, backward=True)
            return
        step = self._step
        if step is None or step.forward_done:
            if step is not None:
                self._close_step(finished=False)
            step = self._begin_step(ms)
            if not self._guard.active:
                self._guard.__enter__()
        if ms.slots:
            self._fetch_in_step(step, ms, backward=False)

    def _fetch_in_step(self, step: StepState, ms: ModuleHookState, backward: bool) -> None:
        """``ms`` runs as the step's next event: match or record it, fetch, prefetch what follows."""
        code = (ms.index << 1) | backward
        if not step.advance(code):
            self._diverged(step, code)
        fetcher = self._fetcher
        with profile_range("zero.coord.fetch"):
            fetcher.acquire(ms, backward=backward, step=step if step.valid and fetcher.windows else None)
        if step.valid and fetcher.prefetches:
            with profile_range("zero.coord.prefetch"):
                fetcher.prefetch(step)

    def on_post_forward(self, ms: ModuleHookState, output: Any, recompute: bool, *, failed: bool) -> None:
        """Post-forward of a hooked module: release, and end an eval step at its root.

        ``failed``: the forward raised; at the step's root the step is abandoned (a partial
        order is never recorded as a trace).
        """
        if ms.slots:
            with profile_range("zero.coord.release"):
                self._releaser.release_module(ms, self._step, backward=recompute, recompute=recompute)
        step = self._step
        if recompute or step is None or step.root is not ms or step.forward_done:
            return
        self._guard.__exit__(None, None, None)
        if failed:
            self._close_step(finished=False)
            return
        step.forward_done = True
        if step.phase is Phase.EVAL or not collect_grad_tensors(output, []):
            self._close_step(finished=True)

    def on_forward_error(self, ms: ModuleHookState, error: BaseException) -> None:
        """A hooked module's forward raised: add the fix to a not-gathered-parameter error.

        See :func:`zero_coord.error_hints.annotate_unseen_parameter`.
        """
        annotate_unseen_parameter(error, self._model, ms.name, [s.name for s in self._table.slots])

    def on_pre_backward(self, ms: ModuleHookState) -> None:
        """Before ``ms``'s backward: queue the final callback, fetch, prefetch."""
        if not self._callback_queued:
            self._queue_final_callback()
        step = self._step
        if step is not None and step.forward_done:
            self._fetch_in_step(step, ms, backward=True)
        else:
            with profile_range("zero.coord.fetch"):
                self._fetcher.acquire(ms, backward=True)

    def on_post_backward(self, ms: ModuleHookState) -> None:
        """After ``ms``'s input gradients exist: release what has its gradient already."""
        with profile_range("zero.coord.release"):
            self._releaser.release_module(ms, self._step, backward=True)

    def on_grad_accumulated(self, param: torch.Tensor, slot: ParamSlot | None) -> None:
        """Post-accumulate-grad: hand the gradient to the sink, then release if the module is done."""
        if not self._callback_queued:
            self._queue_final_callback()
        if self._sink is not None:
            self._sink.on_grad_ready(param)
        if slot is None:
            return
        if not slot.grad_ready:
            self._live.note_grad_ready(slot)
        if slot.release_on_grad:
            self._live.set_release_on_grad(slot, False)
            if slot.holds == 0 and slot.batch is not None:
                with profile_range("zero.coord.release"):
                    self._releaser.settle([slot], self._step)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        """Final backward callback: release what is left, flush the sink, close the step."""
        self._callback_queued = False
        step = self._step
        nested = step is not None and not step.forward_done  # a backward run inside a forward
        with profile_range("zero.coord.release"):
            self._release_everything(force=not nested)
        if self._sink is not None:
            self._sink.on_backward_end()
        if step is not None and step.forward_done and self._step is step:
            self._close_step(finished=True)

    # ------------------------------------------------------------------ steps and traces

    def _trace_for(self, phase: Phase, root: ModuleHookState) -> Trace:
        key = (phase, root.index)
        trace = self._traces.get(key)
        if trace is None:
            trace = Trace(phase, root.name, self._names)
            self._traces[key] = trace
        return trace

    def _begin_step(self, root: ModuleHookState) -> StepState:
        # A backward that raised never ran its final callback: let the next one queue it.
        self._callback_queued = False
        phase = Phase.TRAIN if torch.is_grad_enabled() and root.module.training else Phase.EVAL
        if self._frozen and phase is Phase.TRAIN:
            self._hook_unfrozen()
        trace = self._trace_for(phase, root)
        step = StepState(phase, root, trace)
        self._step = step
        # Nothing recorded to tell a departure by: check each collective's path this step.
        recording_paths(step.recording)
        return step

    def _close_step(self, finished: bool) -> None:
        """End the step: on a finished step record or check the trace; release; close stats."""
        step = self._step
        if step is None:
            return
        if finished:
            if step.recording:
                step.trace.complete(self._module_slots)
            elif step.valid and step.cursor != len(step.trace):
                self._diverged(step, None)
        elif step.recording:
            step.trace.begin_step()  # an abandoned recording restarts next step
        recording_paths(False)
        self._guard.__exit__(None, None, None)
        self._release_everything(force=True)
        self._step = None
        self._last = self._acc.close(step.phase, self._live.live)
        self._total = self._total + self._last

    def _diverged(self, step: StepState, code: int | None) -> None:
        """The step departs from its valid trace at event ``code`` (``None``: it ended early)."""
        trace = step.trace
        reason = trace.divergence(step.cursor, code)
        # Before anything is gathered along the new path: do the other ranks depart alike?
        # (A gather of another size than the peers' aborts the process inside gloo.)
        path_diverged(trace.departure(step.cursor, code))
        step.valid = False
        self._acc.trace_invalidations += 1
        self._live.drop_prefetched()
        first = trace.invalidate(reason)
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "%s; prefetching is off until the next step records the new order (later divergences of this "
            "trace are logged at DEBUG). If ranks take different module paths, mark the block with "
            "zero_coord.set_leaf_modules().",
            reason,
        )

    def _release_everything(self, force: bool) -> None:
        """Free every live parameter (``force``) or every unheld one; reset per-backward flags."""
        if force:
            for ms in self._states:
                ms.active = 0
            for ms in self._manual_states.values():
                ms.active = 0
        self._live.free_all(force)
