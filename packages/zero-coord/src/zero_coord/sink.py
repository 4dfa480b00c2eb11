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

    ``on_backward_end()`` is called once from the final backward callback, after every
    ``on_grad_ready`` of that backward and after the coordinator released the parameters:
    the sink flushes its buckets and waits for in-flight reductions there. Parameters that
    got no gradient on this rank in this backward (unused branches) get no
    ``on_grad_ready`` call.

    Ordering: on ranks running the same module path, ``on_grad_ready`` calls come in the
    same order on every rank, so collectives issued from it match. Where ranks take
    different paths inside a leaf module (mixture of experts), they do not: such a sink must
    reduce those parameters at ``on_backward_end`` in a fixed order
    (``zero_params.reduce_scatter_grads`` treats a missing ``.grad`` as zeros).
    """

    def on_grad_ready(self, param: nn.Parameter) -> None: ...

    def on_backward_end(self) -> None: ...
