"""Which parameters train is fixed at ``initialize``: a later ``requires_grad`` change is refused."""

from __future__ import annotations

from torch import nn

__all__ = ["RequiresGradChangedError", "TrainableSet"]

_HOW = (
    "zero builds the optimizer (fp32 masters, optimizer state, gradient partitions) for the "
    "parameters that require grad at zero_full.initialize. Set requires_grad before initialize; to "
    "change it later, save (engine.save_pretrained or engine.save_checkpoint), build a new model "
    "with the new requires_grad, initialize it and load the weights (engine.load_pretrained)"
)


class RequiresGradChangedError(RuntimeError):
    """A parameter's ``requires_grad`` changed after ``initialize`` (names each one)."""


class TrainableSet:
    """The names of the parameters that required grad at ``initialize``.

    Args:
        module: The engine's model.
    """

    __slots__ = ("_module", "_trainable")

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._trainable = self._now()

    def __repr__(self) -> str:
        return f"TrainableSet({len(self._trainable)} trainable)"

    def _now(self) -> frozenset[str]:
        return frozenset(n for n, p in self._module.named_parameters() if p.requires_grad)

    def check(self) -> None:
        """Raise if the parameters that require grad differ from those at ``initialize``.

        Raises:
            RequiresGradChangedError: lists the frozen and the unfrozen parameters and the fix.
        """
        now = self._now()
        if now == self._trainable:
            return
        frozen = sorted(self._trainable - now)
        unfrozen = sorted(now - self._trainable)
        parts = []
        if frozen:
            parts.append(f"frozen after initialize: {_names(frozen)}")
        if unfrozen:
            parts.append(f"unfrozen after initialize: {_names(unfrozen)}")
        raise RequiresGradChangedError(f"requires_grad changed ({'; '.join(parts)}): {_HOW}")


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
