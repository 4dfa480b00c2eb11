"""``engine.gathered_for_inference()``: gather every parameter once, run many forwards."""

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
    """See the module docstring. Collective on entry and exit: every rank enters it."""
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
