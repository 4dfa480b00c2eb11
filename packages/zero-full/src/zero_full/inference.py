"""``engine.gathered_for_inference()``: gather every parameter once, run many forwards.

Under stage 3 each forward gathers every layer and releases it again; ``model.generate``
runs one forward per token, so a 64-token generation gathers the whole model 64 times.
Inside this context the partitioned parameters are gathered once on entry (one coalesced
all-gather per gather strategy, dtype and device — ``zero_params.gather``), the
coordinator's hooks are paused (:meth:`zero_coord.Coordinator.pause`: installed, doing
nothing), ``torch.no_grad()`` is on, and everything is released on exit.

Budget: the gathered parameters need ``sum(numel * itemsize)`` bytes on every rank. With
``budget_bytes`` smaller than that the context raises before gathering anything, naming
the bytes needed: generate without the context (per-layer gathering by the hooks, bounded
by ``stage3_max_live_parameters``) when the whole model does not fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.profiler import record_function

import zero_params
from zero_coord import Coordinator

__all__ = ["gathered_bytes", "gathered_for_inference"]


def _partitioned(module: nn.Module) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in module.parameters():
        if zero_params.is_partitioned(p) and not zero_params.state_of(p).persistent:
            seen.setdefault(id(p), p)
    return list(seen.values())


def gathered_bytes(module: nn.Module) -> int:
    """Bytes the partitioned (non-persistent) parameters of ``module`` take when all gathered."""
    total = 0
    for p in _partitioned(module):
        st = zero_params.state_of(p)
        total += st.numel * torch.empty((), dtype=st.dtype).element_size()
    return total


@contextlib.contextmanager
def gathered_for_inference(
    module: nn.Module, coordinator: Coordinator | None, budget_bytes: int | None = None
) -> Iterator[None]:
    """See the module docstring. Collective on entry and exit: every rank enters it.

    Args:
        module: The engine's model.
        coordinator: Its parameter coordinator (``None`` below stage 3: nothing to gather).
        budget_bytes: The most bytes the gathered parameters may take (``None``: no limit).

    Raises:
        ValueError: ``budget_bytes`` is smaller than the gathered model (the message names both).
    """
    if coordinator is None:  # stages 0-2: parameters are whole already
        with torch.no_grad():
            yield
        return
    params = _partitioned(module)
    need = gathered_bytes(module)
    if budget_bytes is not None and need > budget_bytes:
        raise ValueError(
            f"gathered_for_inference(budget_bytes={budget_bytes}): gathering {type(module).__name__} "
            f"needs {need} bytes per rank; pass budget_bytes >= {need} (or None), or run the forwards "
            "without this context so the hooks gather layer by layer"
        )
    with coordinator.pause(), torch.no_grad():
        with record_function("zero.inference.gather"):
            zero_params.gather(params, async_op=False)
        try:
            yield
        finally:
            with record_function("zero.inference.release"):
                zero_params.release(params)
