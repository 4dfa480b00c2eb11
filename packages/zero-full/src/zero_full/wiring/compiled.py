"""``torch.compile`` and the engine: what works, and the errors where it cannot."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["check_not_precompiled", "compile_model", "explain_graph_break"]

_FULLGRAPH = (
    "fullgraph=True cannot work under ZeRO stage 3: the coordinator gathers and releases parameters "
    "in hooks at every module boundary, which run eagerly (graph breaks); compile without fullgraph"
)


def _is_optimized_module(model: nn.Module) -> bool:
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


def check_not_precompiled(model: nn.Module) -> None:
    """Refuse a module already wrapped by ``torch.compile``.

    Raises:
        TypeError: ``model`` is an ``OptimizedModule`` (naming the fix: compile after ``initialize``).
    """
    if _is_optimized_module(model):
        raise TypeError(
            "initialize got a module compiled by torch.compile (OptimizedModule): pass the plain model "
            "to zero_full.initialize, then compile it in place with engine.compile(...) (or "
            "model.compile(...)), so the engine's hooks exist when it is traced"
        )


def compile_model(model: nn.Module, stage: int, **kwargs: Any) -> None:
    """``model.compile(**kwargs)`` in place, refusing what cannot work."""
    if stage == 3 and kwargs.get("fullgraph"):
        raise ValueError(_FULLGRAPH)
    model.compile(**kwargs)


def explain_graph_break(exc: BaseException, stage: int) -> None:
    """Add a note to dynamo's error for a stage-3 hook met under ``fullgraph=True``."""
    if stage == 3 and type(exc).__module__.startswith("torch._dynamo") and "compiler.disable" in str(exc):
        exc.add_note(_FULLGRAPH)
