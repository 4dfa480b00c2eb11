"""The interface through which the coordinator hands gradients to the optimizer."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["GradientSink"]


@runtime_checkable
class GradientSink(Protocol):
    """Receives gradients as backward produces them (implemented by zero-optim).

    ``on_grad_ready(param)`` is called from the parameter's post-accumulate-grad hook:
    ``param.grad`` holds the full accumulated gradient of this backward and the parameter
    is still gathered. The sink reduce-scatters it (possibly bucketed or asynchronously)
    with ``zero_params.reduce_scatter_grads``, which frees ``.grad``.
    """

    def on_grad_ready(self, param: nn.Parameter) -> None: ...

    def on_backward_end(self) -> None: ...
