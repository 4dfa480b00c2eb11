"""External parameters: parameters a module uses but does not own (tied weights, shared tables).

Each module that has any gets ONE state object, :class:`ModuleParamsState`, stored as
``module._zero_params``; the coordinator (zero-coord) reads :func:`external_parameters`
and gathers those parameters together with the module's own.
"""

from __future__ import annotations

import dataclasses

from torch import nn

__all__ = [
    "ModuleParamsState",
    "external_parameters",
    "module_params_state",
    "register_external_parameter",
    "unregister_external_parameter",
]

MODULE_STATE_ATTR = "_zero_params"


@dataclasses.dataclass(eq=False, slots=True)
class ModuleParamsState:
    """Per-module zero_params state.

    Attributes:
        external: Parameters the module uses but does not own, keyed by ``id`` (insertion
            ordered, so every rank gathers them in the same order).
    """

    external: dict[int, nn.Parameter] = dataclasses.field(default_factory=dict)


def module_params_state(module: nn.Module, *, create: bool = False) -> ModuleParamsState | None:
    """The module's :class:`ModuleParamsState` (created on demand if ``create``)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    state = module.__dict__.get(MODULE_STATE_ATTR)
    if state is None and create:
        state = ModuleParamsState()
        object.__setattr__(module, MODULE_STATE_ATTR, state)
    return state


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``param``, which ``module`` does not own.

    Under ZeRO-3 the parameter is then gathered before ``module``'s forward and backward,
    like the module's own parameters (e.g. an output layer reading the tied embedding
    weight, or any weight read in another module's forward). Registering twice is a no-op.
    """
    if not isinstance(param, nn.Parameter):
        raise TypeError(
            f"register_external_parameter: expected an nn.Parameter, got {type(param).__name__}; "
            "only parameters are gathered"
        )
    state = module_params_state(module, create=True)
    state.external.setdefault(id(param), param)


def unregister_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`.

    Raises:
        ValueError: ``param`` is not registered as external on ``module``.
    """
    state = module_params_state(module)
    if state is None or state.external.pop(id(param), None) is None:
        raise ValueError(
            f"unregister_external_parameter: this parameter is not registered as external on "
            f"{type(module).__name__}; nothing to unregister"
        )


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters registered as external on ``module``, in registration order."""
    state = module_params_state(module)
    return [] if state is None else list(state.external.values())
