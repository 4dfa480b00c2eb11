"""Adam / AdamW over flat fp32 tensors on the CPU."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
from torch.optim import adam as _torch_adam

__all__ = ["AdamHyper", "AdamKernel", "CpuAdam", "adam_hyper_from_group", "check_offloadable"]

_BLOCK = 1 << 16
"""Elements per block of the EXACT kernel (256 KiB per fp32 array: five arrays stay in L2)."""


class AdamKernel(enum.Enum):
    """How :class:`CpuAdam` computes the update."""

    FUSED = "fused"
    EXACT = "exact"


@dataclasses.dataclass(frozen=True)
class AdamHyper:
    """The hyperparameters of one Adam / AdamW step (torch's names and meaning)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    maximize: bool = False


def check_offloadable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that :class:`CpuAdam` cannot step in its place.

    Raises:
        TypeError: ``optimizer`` is not ``torch.optim.Adam`` / ``torch.optim.AdamW``.
        ValueError: a group asks for ``amsgrad``, complex or non-float hyperparameters.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(
            f"optimizer offload steps with a CPU Adam and supports torch.optim.Adam and torch.optim.AdamW "
            f"only, got {type(optimizer).__module__}.{type(optimizer).__name__}; use Adam/AdamW or turn "
            "offload_optimizer off"
        )
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise ValueError(
                f"param_groups[{gi}] sets amsgrad=True, which optimizer offload does not support; "
                "set amsgrad=False or turn offload_optimizer off"
            )


def adam_hyper_from_group(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamHyper:
    """The :class:`AdamHyper` of one of ``optimizer``'s ``param_groups`` (read at every step)."""
    beta1, beta2 = group["betas"]
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
    return AdamHyper(
        lr=_scalar(group["lr"]),
        beta1=_scalar(beta1),
        beta2=_scalar(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        decoupled=decoupled,
        maximize=bool(group.get("maximize", False)),
    )


_AdamTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(param, grad, exp_avg, exp_avg_sq)`` of one Adam step."""


def _scalar(value: float | torch.Tensor) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class CpuAdam:
    """One Adam / AdamW update of flat fp32 CPU tensors, in place.

    Args:
        kernel: :attr:`AdamKernel.FUSED` (fast, within float rounding of torch) or
            :attr:`AdamKernel.EXACT` (bit-identical to ``torch.optim.AdamW(foreach=False)``).

    Attributes:
        elements_stepped: Elements updated so far (for accounting and benchmarks).
    """

    __slots__ = ("elements_stepped", "kernel")

    def __init__(self, kernel: AdamKernel = AdamKernel.FUSED) -> None:
        self.kernel = kernel
        self.elements_stepped = 0

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: int,
        hyper: AdamHyper,
    ) -> None:
        """Apply step number ``step`` (1 for the first step) to ``param``, ``exp_avg``, ``exp_avg_sq``.

        Raises:
            ValueError: the tensors are not 1-D fp32 CPU tensors of the same length, or ``step`` < 1.
        """
        tensors = (param, grad, exp_avg, exp_avg_sq)
        _check_flat(*tensors)
        if step < 1:
            raise ValueError(f"Adam step numbers start at 1, got {step}")
        if param.numel() == 0:
            return
        if self.kernel is AdamKernel.FUSED:
            _fused(tensors, step, hyper)
        else:
            for start in range(0, param.numel(), _BLOCK):
                n = min(_BLOCK, param.numel() - start)
                _exact_block(*(t.narrow(0, start, n) for t in tensors), step, hyper)
        self.elements_stepped += param.numel()


def _fused(tensors: _AdamTensors, step: int, hyper: AdamHyper) -> None:
    """torch's fused Adam over ``(param, grad, exp_avg, exp_avg_sq)``."""
    param, grad, exp_avg, exp_avg_sq = tensors
    # the fused kernel increments the step tensor before using it
    step_t = torch.tensor(float(step - 1))
    _torch_adam.adam(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step_t],
        fused=True,
        decoupled_weight_decay=hyper.decoupled,
        amsgrad=False,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        lr=hyper.lr,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        maximize=hyper.maximize,
    )


def _exact_block(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    h: AdamHyper,
) -> None:
    """torch's single-tensor Adam, operation for operation (so the roundings are the same)."""
    if h.maximize:
        grad = -grad
    if h.weight_decay != 0:
        if h.decoupled:
            param.mul_(1 - h.lr * h.weight_decay)
        else:
            grad = grad.add(param, alpha=h.weight_decay)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias_correction1 = 1 - h.beta1**step
    bias_correction2 = 1 - h.beta2**step
    step_size = h.lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _check_flat(*tensors: torch.Tensor) -> None:
    n = tensors[0].numel()
    for t in tensors:
        if t.dim() != 1 or t.dtype != torch.float32 or t.device.type != "cpu" or t.numel() != n:
            raise ValueError(
                "CpuAdam steps 1-D fp32 CPU tensors of one length; got "
                + ", ".join(f"{tuple(x.shape)} {x.dtype} on {x.device}" for x in tensors)
            )
