"""qgZ with error feedback (LoCo-style): int4 noise is carried to the next reduction, not lost.

Needs the optional extra ``pip install zero-comm[quantized]``, like :mod:`zero_comm.quantized`.

:class:`ErrorFeedbackReduceScatter` wraps :class:`~zero_comm.QuantizedReduceScatter`. Before
each reduction it adds this rank's error buffer to the gradients it quantizes, computes the
error the first (local) quantization makes on that compensated gradient, and folds it into the
buffer as a moving average::

    c = g + e
    e = err_beta * e + (1 - err_beta) * (c - dequant(quant(c)))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch
from torch.profiler import record_function

from zero_comm.handles import ReduceScatterHandle

# zero-kernels through zero_comm.quantized, which says how to install it when it is missing
from zero_comm.quantized import (
    QGZ_DEFAULT_CONFIG,
    QuantConfig,
    QuantizedReduceScatter,
    QuantizedTensor,
    _quant_reduce,
    dequantize,
    quantize,
)
from zero_comm.reduction import ReduceOpLike
from zero_comm.topology import Topology

__all__ = ["ErrorFeedbackConfig", "ErrorFeedbackReduceScatter"]


@dataclasses.dataclass(frozen=True)
class ErrorFeedbackConfig:
    """Error feedback of qgZ (DeepSpeed's ``zeropp_loco_param``).

    Attributes:
        err_beta: Moving-average factor of the error buffer, in ``[0, 1)`` (0: classic error
            feedback, the buffer is the last error).
        reset_t: Optimizer steps between resets of the buffers to zero (``>= 1``).
    """

    err_beta: float = 0.8
    reset_t: int = 1024

    def __post_init__(self) -> None:
        if not (isinstance(self.err_beta, int | float) and 0.0 <= float(self.err_beta) < 1.0):
            raise ValueError(f"ErrorFeedbackConfig.err_beta must be in [0, 1), got {self.err_beta!r}")
        if isinstance(self.reset_t, bool) or not isinstance(self.reset_t, int) or self.reset_t < 1:
            raise ValueError(f"ErrorFeedbackConfig.reset_t must be an integer >= 1, got {self.reset_t!r}")


class ErrorFeedbackReduceScatter:
    """qgZ (:class:`~zero_comm.QuantizedReduceScatter`) with error feedback; a ``ReduceScatterStrategy``."""

    __slots__ = ("_call", "_errors", "_hop_errors", "feedback", "group_rank", "group_size", "inner", "steps")

    def __init__(
        self,
        topology: Topology,
        feedback: ErrorFeedbackConfig = ErrorFeedbackConfig(),  # noqa: B008 - frozen
        config: QuantConfig = QGZ_DEFAULT_CONFIG,
    ) -> None:
        if not isinstance(feedback, ErrorFeedbackConfig):
            raise TypeError(
                "ErrorFeedbackReduceScatter: feedback must be an ErrorFeedbackConfig, got "
                f"{type(feedback).__name__}"
            )
        self.inner = QuantizedReduceScatter(topology, config)
        self.feedback = feedback
        self.group_size = self.inner.group_size
        self.group_rank = self.inner.group_rank
        self.steps = 0
        self._call = 0
        self._errors: dict[int, list[torch.Tensor | None]] = {}
        self._hop_errors: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        f = self.feedback
        return f"ErrorFeedbackReduceScatter({self.inner!r}, err_beta={f.err_beta}, reset_T={f.reset_t})"

    def begin_backward(self) -> None:
        """Mark the start of a backward: the next reduction is the first of its sequence."""
        self._call = 0

    def step_done(self) -> None:
        """Count an optimizer step; every ``reset_T`` steps the error buffers go back to zero."""
        self.steps += 1
        if self.steps % self.feedback.reset_t == 0:
            self._errors.clear()
            self._hop_errors.clear()

    def error_numel(self) -> int:
        """Elements held in error buffers (for memory reports)."""
        first = sum(e.numel() for errs in self._errors.values() for e in errs if e is not None)
        return first + sum(e.numel() for e in self._hop_errors.values())

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], *, op: ReduceOpLike = "avg", async_op: bool = False
    ) -> ReduceScatterHandle:
        """Compensate, update the error buffers, reduce as :func:`zero_comm.all_to_all_quant_reduce` does."""
        slot = self._call
        self._call += 1
        world = self.group_size
        if world == 1 or not tensors:
            return self.inner.reduce_scatter_coalesced(tensors, op=op, async_op=async_op)
        with record_function("zero.quantized_reduce_scatter.error_feedback"), torch.no_grad():
            errors = self._buffers(slot, tensors)
            eligible = [i for i, e in enumerate(errors) if e is not None]
            sent = list(tensors)
            for i in eligible:
                sent[i] = (tensors[i].float() + errors[i].float()).to(tensors[i].dtype)
            if eligible:
                residual = _first_hop_error([sent[i] for i in eligible], world, self.inner.config)
                beta = float(self.feedback.err_beta)
                for i, r in zip(eligible, residual, strict=True):
                    err = errors[i]
                    err.copy_((err.float() * beta).add_(r, alpha=1.0 - beta).view_as(err))
        inner = self.inner
        return _quant_reduce(
            sent,
            inner.topology,
            inner.config,
            op,
            async_op,
            inner._logged,  # noqa: SLF001 - the wrapped strategy's once-per-object log state
            "ErrorFeedbackReduceScatter",
            functools.partial(self._requantize, slot),
        )

    def _requantize(self, slot: int, partial: torch.Tensor) -> QuantizedTensor:
        """Second-hop error feedback: quantize ``partial + e2`` and fold the new error into ``e2``."""
        with record_function("zero.quantized_reduce_scatter.error_feedback"), torch.no_grad():
            err = self._hop_errors.get(slot)
            if err is None or err.shape != partial.shape:
                err = torch.zeros_like(partial, dtype=torch.float32)
                self._hop_errors[slot] = err
            compensated = partial.float() + err
            q = quantize(compensated, self.inner.config)
            beta = float(self.feedback.err_beta)
            err.mul_(beta).add_(compensated - dequantize(q), alpha=1.0 - beta)
        return q

    def _buffers(self, slot: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This position's error buffers (zeros when new or when the shapes changed)."""
        world = self.group_size
        errors = self._errors.get(slot)
        fits = errors is not None and len(errors) == len(tensors)
        if fits:
            for t, e in zip(tensors, errors, strict=True):
                want = _eligible(t, world)
                if (e is None) == want or (e is not None and (e.shape != t.shape or e.dtype != t.dtype)):
                    fits = False
                    break
        if not fits:
            errors = [torch.zeros_like(t) if _eligible(t, world) else None for t in tensors]
            self._errors[slot] = errors
        return errors


def _eligible(t: torch.Tensor, world: int) -> bool:
    """Whether qgZ quantizes ``t`` (the rule of :func:`zero_comm.all_to_all_quant_reduce`)."""
    return t.dim() >= 2 and t.numel() % world == 0 and t.numel() > 0


def _first_hop_error(tensors: list[torch.Tensor], world: int, config: QuantConfig) -> list[torch.Tensor]:
    """``x - dequant(quant(x))`` per tensor, with qgZ's grouping (fp32, each tensor's shape).

    qgZ lays the tensors out as rows (row ``p`` = every tensor's partition ``p``), pads each row
    to whole groups and quantizes; the swizzle only reorders rows, so quantizing the padded rows
    here makes exactly the same groups.
    """
    widths = [t.numel() // world for t in tensors]
    rows = torch.cat([t.reshape(world, w).float() for t, w in zip(tensors, widths, strict=True)], dim=1)
    width = rows.shape[1]
    padded = math.ceil(width / config.group_size) * config.group_size
    if padded != width:
        rows = torch.nn.functional.pad(rows, (0, padded - width))
    deq = dequantize(quantize(rows.reshape(-1), config)).view(world, padded)
    residual = (rows - deq)[:, :width]
    return [
        part.reshape(t.shape) for t, part in zip(tensors, torch.split(residual, widths, dim=1), strict=True)
    ]
