"""The coordinator: which partitioned parameters are gathered when, and when they are freed.

Lifecycle of one training step (hooks are bound methods of :mod:`zero_coord.hooks` objects):

1. Root pre-forward starts the step and picks its trace (per phase and root module).
2. Each hooked module's pre-forward *fetches*: waits for its parameters that are in flight,
   gathers the missing ones in one coalesced call, then (with a complete trace) prefetches
   the next modules of the trace. Its inputs go through :class:`~zero_coord.hooks.PostBackward`.
3. Post-forward *releases* the parameters no running module holds, unless the trace says they
   are used again within ``max_reuse_distance`` elements; outputs go through
   :class:`~zero_coord.hooks.PreBackward`.
4. Backward: ``PreBackward`` fetches again (prefetching in recorded backward order; over the hpZ
   secondary group where parameters have one) and queues the final callback once;
   ``PostBackward`` releases, except parameters whose gradient has not been accumulated yet:
   the post-accumulate-grad hook hands the gradient to the :class:`GradientSink` first and
   releases after.
5. The final callback releases everything left, calls ``GradientSink.on_backward_end`` and
   closes the step (trace recorded or validated, stats closed). Eval steps end at the root's
   post-forward.

Every decision (what to gather, prefetch, keep or free) depends only on the module order and
sizes, never on timing, so all ranks issue the same collectives in the same order.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

import zero_params
from zero_comm.watchdog import label, path_diverged, recording_paths
from zero_comm.watchdog import note as watchdog_note
from zero_coord._profile import profile_range
from zero_coord._tree import collect_grad_tensors
from zero_coord.config import CoordinatorConfig, Phase
from zero_coord.error_hints import annotate_unseen_parameter
from zero_coord.hooks import GatherBatch, GradHook, HookSet, ModuleHookState, ParamSlot
from zero_coord.leaf import find_leaf_modules
from zero_coord.prefetch_source import ShardPrefetcher
from zero_coord.sink import GradientSink
from zero_coord.stats import StatsAccumulator, StepStats
from zero_coord.trace import Trace

__all__ = ["Coordinator"]

logger = logging.getLogger("zero.coord")


class _Step:
    """State of the step in progress."""

    __slots__ = (
        "cursor",
        "forward_done",
        "phase",
        "prefetch_pos",
        "recording",
        "root",
        "trace",
        "valid",
    )

    def __init__(self, phase: Phase, root: ModuleHookState, trace: Trace, valid: bool) -> None:
        self.phase = phase
        self.root = root
        self.trace = trace
        self.valid = valid  # validating against a complete trace, no divergence so far
        self.recording = not valid
        self.cursor = 0  # next trace position
        self.prefetch_pos = 0  # first trace position not yet considered for prefetch
        self.forward_done = False


class Coordinator:
    """Gathers, prefetches and releases the partitioned parameters of ``model`` around its modules.

    Args:
        model: The model whose parameters were partitioned with ``zero_params.partition``
            (or built under ``zero_params.Init``). Parameters that are not partitioned are
            left alone.
        config: Prefetch and release policy.
        grad_sink: Receives each gradient once accumulated and the end of each backward
            (``None``: gradients stay in ``.grad`` and nothing is reduced).
        shard_prefetch: With offloaded shards (``offload_param``), asked to swap in the shards
            of the upcoming trace modules after each fetch, so swap-in overlaps compute
            (``None``: shards are where gathers read them).

    Example:
        >>> coord = Coordinator(model, CoordinatorConfig(prefetch_bucket_size=10**6), sink)
        >>> coord.install()
        >>> loss = model(batch).sum(); loss.backward()   # gathers / releases happen in hooks
        >>> coord.last_step_stats.prefetch_hit_rate
    """

    def __init__(
        self,
        model: nn.Module,
        config: CoordinatorConfig = CoordinatorConfig(),  # noqa: B008 - frozen, immutable default
        grad_sink: GradientSink | None = None,
        shard_prefetch: ShardPrefetcher | None = None,
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
        self._sink = grad_sink
        self._shard_prefetch = shard_prefetch
        self._hooks = HookSet()
        self._installed = False
        self._paused = False
        self._states: list[ModuleHookState] = []
        self._state_of: dict[nn.Module, ModuleHookState] = {}
        self._manual_states: dict[nn.Module, ModuleHookState] = {}
        self._slots: list[ParamSlot] = []
        self._slot_of: dict[nn.Parameter, ParamSlot] = {}
        self._param_names: dict[nn.Parameter, str] = {}
        self._module_slots: list[tuple[ParamSlot, ...]] = []
        self._names: list[str] = []
        self._traces: dict[tuple[Phase, int], Trace] = {}
        self._step: _Step | None = None
        self._live = 0
        # Gathered elements whose module finished backward but whose gradient is not accumulated yet
        # (e.g. a tied embedding, waiting for its other use): autograd holds them, like a running module,
        # so they do not count against max_live_parameters when prefetching.
        self._pending_grad_numel = 0
        self._live_slots: dict[ParamSlot, None] = {}
        self._ahead: dict[ParamSlot, None] = {}
        self._ahead_numel = 0
        self._retained: dict[ParamSlot, None] = {}
        self._grad_ready: list[ParamSlot] = []
        self._frozen: list[nn.Parameter] = []
        self._callback_queued = False
        self._acc = StatsAccumulator()
        self._last = StepStats()
        self._total = StepStats()
        # Active from a step's root pre-forward to its post-forward: a saved view of a released
        # parameter read by backward raises a PartitionedParameterError naming it.
        self._guard = zero_params.SavedTensorGuard(
            lambda: [zero_params.state_of(s.param) for s in self._slots]
        )

    def __repr__(self) -> str:
        return (
            f"Coordinator({type(self._model).__name__}, installed={self._installed}, "
            f"hooked_modules={len(self._states)}, params={len(self._slots)})"
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
    def live_elements(self) -> int:
        """Parameter elements currently gathered or in flight through this coordinator."""
        return self._live

    @property
    def last_step_stats(self) -> StepStats:
        """Statistics of the last finished step (empty before the first)."""
        return self._last

    @property
    def total_stats(self) -> StepStats:
        """Running total over every finished step since construction."""
        return self._total

    def install(self) -> None:
        """Install every hook: forward pre/post hooks on the modules that need parameters (and
        on the root), pre-/post-backward nodes through them, post-accumulate-grad hooks on the
        partitioned parameters; the final backward callback is queued per backward.

        Reads the leaf marking (:func:`~zero_coord.set_leaf_modules`) and the external
        parameters (``zero_params.register_external_parameter``) now: change those before
        installing, or :meth:`remove` and install again.

        Raises:
            RuntimeError: the hooks are already installed.
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
        self._slots = []
        self._slot_of = {}
        self._frozen = []
        self._module_slots = []
        self._names = []
        self._traces = {}
        self._step = None

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

        Raises:
            RuntimeError: the hooks are not installed.
            ValueError: ``module`` is not part of the model.
        """
        ms = self._manual_state(module)
        if ms.slots:
            with profile_range("zero.coord.fetch"):
                self._acquire(ms)

    def release(self, module: nn.Module) -> None:
        """Drop one hold of ``module``'s parameters taken by :meth:`fetch`; free them when unheld."""
        ms = self._manual_state(module)
        if ms.slots:
            with profile_range("zero.coord.release"):
                self._release_module(ms, backward=False)

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
        """Drop every trace silently; the next step of each phase records again.

        Call it when you know the module order changes (a different generation mode, adapters
        switched on or off, a branch toggled): this avoids the divergence log line and the
        prefetches of the stale order. Not needed after an optimizer step (values change,
        order does not). Structural changes (new modules, new external parameters, new leaf
        marking, re-partitioning) need :meth:`remove` + :meth:`install` instead.
        """
        for trace in self._traces.values():
            trace.invalidate(None)
        step = self._step
        if step is not None and (step.valid or step.recording):
            step.valid = False
            step.recording = False
            self._drop_prefetched()

    # ------------------------------------------------------------------ construction

    def _require_installed(self, what: str) -> None:
        if not self._installed:
            raise RuntimeError(f"Coordinator.{what}(): call install() first")

    def _build(self) -> None:
        self._reset_structure()
        model = self._model
        self._param_names = {}
        for name, param in model.named_parameters():
            self._param_names.setdefault(param, name)
        leaves = find_leaf_modules(model)
        leaf_modules = set(leaves.values())
        inside_leaf: set[nn.Module] = set()
        for leaf in leaves.values():
            inside_leaf.update(sub for sub in leaf.modules() if sub is not leaf)
        for name, module in model.named_modules():
            if module in inside_leaf:
                continue
            slots = self._slots_for(module, name, leaf=module in leaf_modules)
            if slots or module is model:
                self._add_state(module, name, slots, module in leaf_modules)

    def _add_state(self, module: nn.Module, name: str, slots: tuple[ParamSlot, ...], leaf: bool) -> None:
        ms = ModuleHookState(self, module, name, len(self._states), slots, leaf)
        self._states.append(ms)
        self._state_of[module] = ms
        self._module_slots.append(slots)
        self._names.append(name)

    def _slots_for(self, module: nn.Module, name: str, leaf: bool) -> tuple[ParamSlot, ...]:
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
        slot = self._slot_of.get(param)
        if slot is not None:
            return slot
        if not zero_params.is_partitioned(param):
            return None
        state = zero_params.state_of(param)
        name = self._param_names.get(param) or state.name or f"{module_name}.<external parameter>"
        if not state.name:
            state.name = name  # lets zero_params' errors name it
        if state.persistent:
            return None
        numel = state.numel
        slot = ParamSlot(param, name, len(self._slots), numel, numel * param.element_size())
        self._slots.append(slot)
        self._slot_of[param] = slot
        return slot

    def _register_hooks(self) -> None:
        hooks = self._hooks
        for ms in self._states:
            hooks.add(ms.module.register_forward_pre_hook(ms.pre_forward, prepend=True, with_kwargs=True))
            hooks.add(ms.module.register_forward_hook(ms.post_forward, always_call=True))
        seen: set[nn.Parameter] = set()
        self._frozen = []
        for param in list(self._model.parameters()) + [s.param for s in self._slots]:
            if param in seen or not zero_params.is_partitioned(param):
                continue
            seen.add(param)
            if param.requires_grad:
                self._add_grad_hook(param)
            else:
                self._frozen.append(param)

    def _add_grad_hook(self, param: nn.Parameter) -> None:
        hook = GradHook(self, self._slot_of.get(param))
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
                ms = ModuleHookState(self, module, name, -1, self._slots_for(module, name, leaf=False), False)
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
                    self._acquire(ms, backward=True)
            return
        step = self._step
        if step is None or step.forward_done:
            if step is not None:
                self._close_step(finished=False)
            step = self._begin_step(ms)
            if not self._guard.active:
                self._guard.__enter__()
        if ms.slots:
            self._advance(step, ms.index << 1)
            with profile_range("zero.coord.fetch"):
                self._acquire(ms)
            if step.valid and (self._config.prefetch_bucket_size or self._shard_prefetch is not None):
                with profile_range("zero.coord.prefetch"):
                    self._prefetch(step)

    def on_post_forward(self, ms: ModuleHookState, output: Any, recompute: bool, *, failed: bool) -> None:
        """Post-forward of a hooked module: release, and end an eval step at its root.

        ``failed``: the forward raised; at the step's root the step is abandoned (a partial
        order is never recorded as a trace).
        """
        if ms.slots:
            with profile_range("zero.coord.release"):
                self._release_module(ms, backward=recompute, recompute=recompute)
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
        annotate_unseen_parameter(error, self._model, ms.name, [s.name for s in self._slots])

    def on_pre_backward(self, ms: ModuleHookState) -> None:
        """Before ``ms``'s backward: queue the final callback, fetch, prefetch."""
        self._queue_final_callback()
        step = self._step
        if step is not None and step.forward_done:
            self._advance(step, (ms.index << 1) | 1)
            with profile_range("zero.coord.fetch"):
                self._acquire(ms, backward=True)
            if step.valid and (self._config.prefetch_bucket_size or self._shard_prefetch is not None):
                with profile_range("zero.coord.prefetch"):
                    self._prefetch(step)
        else:
            with profile_range("zero.coord.fetch"):
                self._acquire(ms, backward=True)

    def on_post_backward(self, ms: ModuleHookState) -> None:
        """After ``ms``'s input gradients exist: release what has its gradient already."""
        with profile_range("zero.coord.release"):
            self._release_module(ms, backward=True)

    def on_grad_accumulated(self, param: torch.Tensor, slot: ParamSlot | None) -> None:
        """Post-accumulate-grad: hand the gradient to the sink, then release if the module is done."""
        self._queue_final_callback()
        if self._sink is not None:
            self._sink.on_grad_ready(param)
        if slot is None:
            return
        if not slot.grad_ready:
            slot.grad_ready = True
            self._grad_ready.append(slot)
        if slot.release_on_grad:
            self._set_release_on_grad(slot, False)
            if slot.holds == 0 and slot.batch is not None:
                with profile_range("zero.coord.release"):
                    self._settle([slot])

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

    def _begin_step(self, root: ModuleHookState) -> _Step:
        # A backward that raised never ran its final callback: let the next one queue it.
        self._callback_queued = False
        phase = Phase.TRAIN if torch.is_grad_enabled() and root.module.training else Phase.EVAL
        if self._frozen and phase is Phase.TRAIN:
            self._hook_unfrozen()
        trace = self._trace_for(phase, root)
        step = _Step(phase, root, trace, valid=trace.begin_step())
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
        self._last = self._acc.close(step.phase, self._live)
        self._total = self._total + self._last

    def _advance(self, step: _Step, code: int) -> None:
        """Validate (or record) the next trace event."""
        if step.valid:
            codes = step.trace._codes
            cursor = step.cursor
            if cursor < len(codes) and codes[cursor] == code:
                step.cursor = cursor + 1
                return
            self._diverged(step, code)
        elif step.recording:
            step.trace._codes.append(code)

    def _diverged(self, step: _Step, code: int | None) -> None:
        trace = step.trace
        cursor = step.cursor
        expected = trace.describe_code(trace._codes[cursor]).describe() if cursor < len(trace) else None
        where = f"{trace.phase.name} trace of {trace.root or '<root>'!r} (event {cursor} of {len(trace)})"
        if code is None:
            what = f"the step ended where {expected} was expected next"
        elif expected is None:
            what = f"module {trace.describe_code(code).describe()} ran after the recorded order ended"
        else:
            what = f"module {trace.describe_code(code).describe()} ran where {expected} was expected"
        reason = f"{where} diverged: {what}"
        # Before anything is gathered along the new path: do the other ranks depart alike?
        # (A gather of another size than the peers' aborts the process inside gloo.)
        path_diverged(_departure(trace, code, expected))
        step.valid = False
        self._acc.trace_invalidations += 1
        self._drop_prefetched()
        first = trace.invalidate(reason)
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "%s; prefetching is off until the next step records the new order (later divergences of this "
            "trace are logged at DEBUG). If ranks take different module paths, mark the block with "
            "zero_coord.set_leaf_modules().",
            reason,
        )

    # ------------------------------------------------------------------ gather / release

    def _acquire(self, ms: ModuleHookState, backward: bool = False) -> None:
        """Hold ``ms``'s parameters: wait for in-flight ones, gather the missing ones (one call).

        ``backward``: gather over the hpZ secondary group where parameters have one.
        """
        acc = self._acc
        missing: list[ParamSlot] = []
        waits: list[GatherBatch] = []
        for s in ms.slots:
            s.holds += 1
            batch = s.batch
            if batch is None:
                missing.append(s)
                continue
            if s.retained:
                s.retained = False
                del self._retained[s]
            if s.prefetched:
                s.prefetched = False
                del self._ahead[s]
                self._ahead_numel -= s.numel
                acc.prefetch_hits += 1
            else:
                acc.reuse_hits += 1
            if batch.handle is not None:
                waits.append(batch)
        ms.active += 1
        if missing:
            acc.prefetch_misses += len(missing)
            if self._retained:
                need = sum(s.numel for s in missing)
                if self._live + need > self._config.max_live_parameters:
                    self._evict(need)
            waits.append(self._gather(missing, secondary=backward))
        for batch in waits:
            batch.wait()

    def _gather(self, slots: list[ParamSlot], secondary: bool) -> GatherBatch:
        """Issue one coalesced async gather for ``slots`` (none of them live).

        ``secondary`` (backward uses): parameters with a valid hpZ secondary shard are gathered
        over their secondary (e.g. intra-node) group; the others over their own group.
        """
        watchdog_note(lambda: label("gathers", [s.name for s in slots]))
        handle = zero_params.gather([s.param for s in slots], async_op=True, secondary=secondary)
        numel = 0
        nbytes = 0
        for s in slots:
            numel += s.numel
            nbytes += s.nbytes
        batch = GatherBatch(handle, numel, len(slots))
        live_slots = self._live_slots
        for s in slots:
            s.batch = batch
            live_slots[s] = None
        self._live += numel
        acc = self._acc
        acc.gathers += 1
        acc.bytes_gathered += nbytes
        if self._live > acc.max_live_elements:
            acc.max_live_elements = self._live
        return batch

    def _prefetch(self, step: _Step) -> None:
        """Prefetch along the trace: gathers within the bucket, then swap-ins of offloaded shards beyond."""
        if self._config.prefetch_bucket_size:
            self._prefetch_gathers(step)
        if self._shard_prefetch is not None:
            self._acc.shard_prefetches += self._shard_prefetch.prefetch(self._upcoming_params(step))

    def _upcoming_params(self, step: _Step) -> Iterator[tuple[nn.Parameter, bool]]:
        """``(param, swap_in)`` along the trace from the current module (see :class:`ShardPrefetcher`).

        First sight of a parameter that is not gathered: ``True`` (it will be gathered there);
        a later sight of any parameter: ``False`` (needed again, keep its shard if resident).
        """
        event_slots = step.trace._event_slots
        seen: set[ParamSlot] = set()
        for pos in range(max(step.cursor - 1, 0), len(event_slots)):  # the current module first
            for s in event_slots[pos]:
                if s in seen:
                    yield s.param, False
                else:
                    seen.add(s)
                    if s.batch is None:
                        yield s.param, True

    def _prefetch_gathers(self, step: _Step) -> None:
        """Issue async gathers (one per module) for the next trace modules within the bucket and bound."""
        room = self._config.prefetch_bucket_size - self._ahead_numel
        pos = max(step.prefetch_pos, step.cursor)
        event_slots = step.trace._event_slots
        codes = step.trace._codes
        end = len(event_slots)
        limit = self._config.max_live_parameters
        ahead = self._ahead
        while pos < end and room > 0:
            add = [s for s in event_slots[pos] if s.batch is None]
            if add:
                numel = sum(s.numel for s in add)
                if self._bounded_live + numel > limit and not self._evict_later_than(step, pos, numel):
                    break
                self._gather(add, secondary=bool(codes[pos] & 1))
                for s in add:
                    s.prefetched = True
                    ahead[s] = None
                self._ahead_numel += numel
                room -= numel
            pos += 1
        step.prefetch_pos = pos

    def _release_module(self, ms: ModuleHookState, backward: bool, recompute: bool = False) -> None:
        """One activation of ``ms`` ended: drop its holds, free or keep what nobody holds.

        ``recompute``: the end of a forward re-run inside backward (activation checkpointing).
        Its backward reads the views autograd just saved, and releasing empties their storage,
        so nothing is freed here: trainable parameters wait for their gradient, frozen ones
        for the end of backward (a reentrant checkpoint's re-run has no backward hooks of
        its own to release them earlier).
        """
        if ms.active == 0:
            return  # already reset (release_all) or never fetched
        ms.active -= 1
        settle: list[ParamSlot] = []
        for s in ms.slots:
            if s.holds > 1:
                s.holds -= 1
                continue
            s.holds = 0
            if s.batch is None:
                continue
            if backward and not s.grad_ready and s.param.requires_grad:
                self._set_release_on_grad(s, True)  # its gradient hook releases it
                continue
            if recompute:
                continue  # frozen: live until the final callback releases it
            settle.append(s)
        if settle:
            self._settle(settle)

    def _settle(self, slots: list[ParamSlot]) -> None:
        """Decide for unheld gathered slots: keep them or free them.

        Kept (with a complete trace): a slot the very next module uses (freeing it would only
        re-gather it at once, so it costs no extra peak); and, within ``max_live_parameters``, a
        slot whose next use lies inside the window prefetching already covered (it counts as
        prefetched; freeing it would turn that use into a miss), or within
        ``max_reuse_distance`` elements.
        """
        step = self._step
        free = slots
        if step is not None and step.valid:
            free = []
            trace = step.trace
            cum = trace._cum_numel
            uses = trace._uses
            cursor = step.cursor
            here = cum[cursor]
            reuse = self._config.max_reuse_distance
            bound = self._config.max_live_parameters
            for s in slots:
                positions = uses.get(s.index, ())
                nxt = bisect.bisect_left(positions, cursor)
                if nxt == len(positions):
                    free.append(s)
                elif positions[nxt] == cursor:  # the very next module uses it: freeing only re-gathers it
                    s.retained = True
                    self._retained[s] = None
                elif self._live > bound:
                    free.append(s)
                elif positions[nxt] < step.prefetch_pos:
                    s.prefetched = True
                    self._ahead[s] = None
                    self._ahead_numel += s.numel
                elif cum[positions[nxt]] - here <= reuse:
                    s.retained = True
                    self._retained[s] = None
                else:
                    free.append(s)
        if free:
            self._free(free)

    def _evict_later_than(self, step: _Step, pos: int, need: int) -> bool:
        """Make room for a prefetch for trace position ``pos``: free kept-for-reuse parameters
        whose next use comes after ``pos`` (they are needed later than what is prefetched),
        until ``need`` more elements fit. Returns whether they fit now."""
        bound = self._config.max_live_parameters
        uses = step.trace._uses
        victims = []
        projected = self._bounded_live
        for s in self._retained:
            if projected + need <= bound:
                break
            positions = uses.get(s.index, ())
            nxt = bisect.bisect_left(positions, step.cursor)
            if nxt == len(positions) or positions[nxt] > pos:
                victims.append(s)
                projected -= s.numel
        if victims:
            self._free(victims)
        return self._bounded_live + need <= bound

    @property
    def _bounded_live(self) -> int:
        """Live elements that count against ``max_live_parameters`` for prefetching: all gathered
        ones except those waiting only for their gradient (autograd holds them)."""
        return self._live - self._pending_grad_numel

    def _set_release_on_grad(self, slot: ParamSlot, flag: bool) -> None:
        if slot.release_on_grad != flag:
            slot.release_on_grad = flag
            self._pending_grad_numel += slot.numel if flag else -slot.numel

    def _evict(self, need: int) -> None:
        """Free kept-for-reuse parameters, oldest first, until ``need`` more elements fit."""
        bound = self._config.max_live_parameters
        while self._retained and self._live + need > bound:
            self._free([next(iter(self._retained))])

    def _free(self, slots: list[ParamSlot]) -> None:
        """Release gathered parameters (waiting for their gather first if still in flight)."""
        for s in slots:
            if s.batch.handle is not None:
                s.batch.wait()
        zero_params.release([s.param for s in slots])
        live_slots = self._live_slots
        for s in slots:
            batch = s.batch
            s.batch = None
            del live_slots[s]
            batch.live -= 1
            self._live -= s.numel  # its own storage was emptied: the bytes are gone now
            if s.retained:
                s.retained = False
                del self._retained[s]
            if s.prefetched:
                s.prefetched = False
                del self._ahead[s]
                self._ahead_numel -= s.numel
            if s.release_on_grad:
                self._set_release_on_grad(s, False)

    def _drop_prefetched(self) -> None:
        """Free parameters prefetched for a trace that no longer holds."""
        dropped = [s for s in self._ahead if s.holds == 0]
        for s in self._ahead:
            s.prefetched = False
        self._ahead.clear()
        self._ahead_numel = 0
        if dropped:
            self._free(dropped)

    def _release_everything(self, force: bool) -> None:
        """Free every live parameter (``force``) or every unheld one; reset per-backward flags."""
        if force:
            free = list(self._live_slots)
            for s in free:
                s.holds = 0
                self._set_release_on_grad(s, False)
            for ms in self._states:
                ms.active = 0
            for ms in self._manual_states.values():
                ms.active = 0
        else:
            free = [s for s in self._live_slots if s.holds == 0]
        if free:
            self._free(free)
        for s in self._grad_ready:
            s.grad_ready = False
        self._grad_ready = []


def _departure(trace: Trace, code: int | None, expected: str | None) -> str:
    """``runs `mid` (forward) where its recorded order has 'out' (forward)`` for the watchdog."""
    has = f"its recorded order has {expected}" if expected is not None else "its recorded order ended"
    if code is None:
        return f"ends its step where {has} next"
    event = trace.describe_code(code)
    return f"runs `{event.module or '<root>'}` ({'backward' if event.backward else 'forward'}) where {has}"
