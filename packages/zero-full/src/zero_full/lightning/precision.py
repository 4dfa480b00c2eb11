"""The precision plugin of :class:`ZeroStrategy`: backward and the optimizer step go through the engine.

Lightning's own plugins call ``loss.backward()``, ``optimizer.step()`` and clip the gradients
they find on the optimizer's parameters. Under zero the gradients live in partitions the
engine owns (reduced across ranks, clipped on the global norm), so this plugin hands
``backward`` and ``step`` to the engine and leaves clipping to the config's
``gradient_clipping`` (filled from ``Trainer(gradient_clip_val=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
    from lightning.fabric.utilities.apply_func import apply_to_collection
    from lightning.pytorch.plugins.precision import Precision
except ImportError as exc:  # the extra is not installed
    raise ImportError("zero_full.lightning needs Lightning: pip install 'zero-full[lightning]'") from exc

if TYPE_CHECKING:
    from zero_full.engine import Engine

__all__ = ["PRECISIONS", "ZeroPrecision"]

PRECISIONS: dict[str, str | None] = {
    "32-true": None,
    "32": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}
"""Lightning precision flags zero runs, and the config section each one enables."""


class ZeroPrecision(Precision):
    """Precision plugin whose ``backward`` / ``optimizer_step`` run on the zero engine.

    Args:
        precision: The Lightning precision flag (one of :data:`PRECISIONS`).
        engine: Returns the strategy's engine (built in ``setup``, after this plugin).
    """

    def __init__(self, precision: str, engine: Callable[[], Engine]) -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self._engine = engine
        section = PRECISIONS[precision]
        self._input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(section or "")

    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs in the working dtype (bf16 / fp16), as the engine's weights are."""
        if self._input_dtype is None:
            return data
        return apply_to_collection(
            data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._input_dtype
        )

    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        """``engine.backward(loss)``: scaled by the loss scale and ``1 / gradient_accumulation_steps``."""
        self._engine().backward(tensor)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure (forward + backward), Lightning's pre-step hooks, then ``engine.step()``.

        Called on every micro-batch (the strategy handles accumulation): the engine steps
        the optimizer only at the accumulation boundary.
        """
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise ValueError(
                "training_step returned None (skip the batch): zero cannot skip a backward inside "
                "an accumulation window; return a loss on every batch"
            )
        self._engine().step()
        return closure_result

    def clip_gradients(
        self, optimizer: Optimizer, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None
    ) -> None:
        """No-op: the engine clips on the global norm (config ``gradient_clipping``)."""
