"""Make a "parameter not gathered" error say which module used it and how to fix that."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from torch import nn

import zero_params

__all__ = ["annotate_unseen_parameter"]

HINT_MARK = "[zero_coord]"


def annotate_unseen_parameter(
    error: BaseException, model: nn.Module, hooked_name: str, param_names: Sequence[str]
) -> None:
    """Append the module that used a not-gathered parameter and the fixes to ``error``, once."""
    if not isinstance(error, zero_params.PartitionedParameterError) or not error.args:
        return
    message = str(error.args[0])
    if HINT_MARK in message:
        return
    named = [name for name in param_names if name and f"'{name}'" in message]
    param = repr(named[0]) if named else "'<the parameter named above>'"
    names = {module: name for name, module in model.named_modules()}
    name, module = _innermost_module(error.__traceback__, names) or (
        hooked_name,
        model.get_submodule(hooked_name),
    )
    kind = type(module).__name__
    hint = (
        f"{HINT_MARK} this happened in the forward of module {name or '<root>'!r} ({kind}). The "
        "coordinator gathers a module's own parameters and those registered as external to it, so "
        "declare the use before Coordinator.install(): zero_params.register_external_parameter("
        f"model.get_submodule({name!r}), model.get_parameter({param})); or, if the block runs its "
        "submodules data-dependently (mixture of experts), gather it as a whole: "
        f"zero_coord.set_leaf_modules(model, [{kind!r}])."
    )
    error.args = (f"{message}\n{hint}", *error.args[1:])


def _innermost_module(tb: TracebackType | None, names: dict[nn.Module, str]) -> tuple[str, nn.Module] | None:
    """The innermost frame of ``tb`` that runs a method of one of the model's modules."""
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and owner in names:
            found = (names[owner], owner)
        tb = tb.tb_next
    return found
