"""Hook state objects and the one place their handles live.

Every hook is a bound method of a small slotted state object (no closures), so a hook can
be inspected and its owner found; every handle goes into one :class:`HookSet`, whose
:meth:`HookSet.remove` takes them all out again.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import torch
from torch import nn
from torch._C import _current_graph_task_id as _graph_task_id  # -1 unless a backward runs here
from torch.utils.hooks import RemovableHandle

from zero_coord._tree import collect_grad_tensors, replace_grad_tensors
from zero_coord.slots import ParamSlot

__all__ = [
    "GradHook",
    "HookSet",
    "HookTarget",
    "ModuleHookState",
    "PostBackward",
    "PreBackward",
]


class HookTarget(Protocol):
    """What the hooks call: the coordinator, seen from its hooks (it satisfies this protocol)."""

    @property
    def paused(self) -> bool:
        """Whether the hooks do nothing (``Coordinator.pause``)."""
        ...

    def on_pre_forward(self, ms: ModuleHookState, recompute: bool) -> None:
        """Before ``ms``'s forward (``recompute``: run inside a backward)."""
        ...

    def on_post_forward(self, ms: ModuleHookState, output: Any, recompute: bool, *, failed: bool) -> None:
        """After ``ms``'s forward (``failed``: it raised)."""
        ...

    def on_forward_error(self, ms: ModuleHookState, error: BaseException) -> None:
        """``ms``'s forward raised ``error``."""
        ...

    def on_pre_backward(self, ms: ModuleHookState) -> None:
        """Before ``ms``'s backward."""
        ...

    def on_post_backward(self, ms: ModuleHookState) -> None:
        """After ``ms``'s input gradients exist."""
        ...

    def on_grad_accumulated(self, param: torch.Tensor, slot: ParamSlot | None) -> None:
        """``param.grad`` holds this backward's full gradient (``slot``: ``None`` if unmanaged)."""
        ...


class HookSet:
    """All hook handles of one coordinator; :meth:`remove` removes every one of them."""

    __slots__ = ("_handles",)

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> None:
        """Keep ``handle`` until :meth:`remove`."""
        self._handles.append(handle)

    def remove(self) -> None:
        """Remove every hook added so far."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def __len__(self) -> int:
        return len(self._handles)


class _ModuleBoundary(torch.autograd.Function):
    """Identity on tensors at a module boundary; its backward calls the module's hook state.

    The outputs are returned detached (not as views of the inputs), so in-place operations
    on them later stay legal. Subclasses say which hook their backward calls.
    """

    @staticmethod
    def forward(ctx: Any, state: ModuleHookState, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.set_materialize_grads(False)
        if len(tensors) == 1:  # the common case, without a generator per call
            return (tensors[0].detach(),)
        return tuple([t.detach() for t in tensors])


class PreBackward(_ModuleBoundary):
    """On a module's outputs: its backward fetches the module's parameters."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.state.pre_backward()
        return (None, *grads)


class PostBackward(_ModuleBoundary):
    """On a module's inputs: its backward runs once the module's backward is done."""

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


def _wrap(fn: type[torch.autograd.Function], state: ModuleHookState, structure: Any) -> Any:
    """Route the grad-requiring tensors of ``structure`` through ``fn`` (one node for all)."""
    if type(structure) is torch.Tensor:  # the common single-tensor output: no traversal
        return fn.apply(state, structure)[0] if structure.requires_grad else structure
    tensors = collect_grad_tensors(structure, [])
    if not tensors:
        return structure
    return replace_grad_tensors(structure, iter(fn.apply(state, *tensors)))


def _wrap_inputs(state: ModuleHookState, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Route the module's grad-requiring inputs through :class:`PostBackward`; ``None``: unchanged."""
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # the common case
        if not args[0].requires_grad:
            return None
        return (PostBackward.apply(state, args[0])[0],), kwargs
    tensors = collect_grad_tensors((args, kwargs), [])
    if not tensors:
        return None
    return replace_grad_tensors((args, kwargs), iter(PostBackward.apply(state, *tensors)))


class ModuleHookState:
    """Hooks of one module: fetch before its forward and backward, release after them."""

    __slots__ = ("active", "coord", "index", "is_leaf", "module", "name", "numel", "slots")

    def __init__(
        self,
        coord: HookTarget,
        module: nn.Module,
        name: str,
        index: int,
        slots: tuple[ParamSlot, ...],
        is_leaf: bool,
    ) -> None:
        self.coord = coord
        self.module = module
        self.name = name
        self.index = index
        self.slots = slots
        self.numel = sum(s.numel for s in slots)
        self.is_leaf = is_leaf
        self.active = 0

    def __repr__(self) -> str:
        return f"ModuleHookState({self.name or '<root>'!r}, params={len(self.slots)}, numel={self.numel})"

    @torch.compiler.disable  # torch.compile: a graph break, the hook runs eagerly
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Forward pre-hook: start a step if none runs, fetch, arm the post-backward node."""
        if self.coord.paused:
            return None
        recompute = _graph_task_id() != -1  # inside a backward (a recompute)
        self.coord.on_pre_forward(self, recompute)
        if self.slots and not recompute and torch.is_grad_enabled():
            return _wrap_inputs(self, args, kwargs)
        return None

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Forward hook (always called): release, arm the pre-backward node, end eval steps.

        Also runs when the forward raised (``output`` is ``None`` and the exception is being
        handled): the parameters are released all the same and the error is annotated.
        """
        if self.coord.paused:
            return output
        error = sys.exc_info()[1] if output is None else None
        if error is not None:
            self.coord.on_forward_error(self, error)
        recompute = _graph_task_id() != -1  # inside a backward (a recompute)
        if self.slots and not recompute and error is None and torch.is_grad_enabled():
            output = _wrap(PreBackward, self, output)
        self.coord.on_post_forward(self, output, recompute, failed=error is not None)
        return output

    def pre_backward(self) -> None:
        """Called by :class:`PreBackward` before the module's backward runs."""
        self.coord.on_pre_backward(self)

    def post_backward(self) -> None:
        """Called by :class:`PostBackward` once the module's input gradients exist."""
        self.coord.on_post_backward(self)


class GradHook:
    """Post-accumulate-grad hook of one parameter: hand the gradient to the sink, then release."""

    __slots__ = ("coord", "slot")

    def __init__(self, coord: HookTarget, slot: ParamSlot | None) -> None:
        self.coord = coord
        self.slot = slot

    def on_grad_accumulated(self, param: torch.Tensor) -> None:
        """Called by autograd once ``param.grad`` holds this backward's full gradient."""
        self.coord.on_grad_accumulated(param, self.slot)
