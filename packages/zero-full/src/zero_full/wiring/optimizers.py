"""The torch optimizer an ``optimizer`` section describes, and the two torch lacks (Lamb, Lion)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from zero_full.config.optimizer import (
    AdagradParams,
    AdamParams,
    LambParams,
    LionParams,
    OptimizerConfig,
    OptimizerType,
    SGDParams,
)

__all__ = ["Lamb", "Lion", "build_optimizer", "optimizer_factory"]


class Lamb(torch.optim.Optimizer):
    """LAMB with the update of DeepSpeed's ``FusedLamb`` (You et al. 2019, as DeepSpeed computes it).

    Per tensor ``p`` with gradient ``g`` at step ``t``::

        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        u = m / (sqrt(v) + eps) + weight_decay * p        # sqrt(v + eps) with eps_inside_sqrt
        r = clip(||p|| / ||u||, min_coeff, max_coeff)      # 1 when either norm is 0
        p = p - step_size * r * u,  step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB update of every parameter with a gradient."""
        loss = _closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in _with_dense_grads(group, "Lamb"):
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                self._update(p, p.grad, state, group, beta1, beta2)
        return loss

    @staticmethod
    def _update(
        p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, beta1: float, beta2: float
    ) -> None:
        exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["eps_inside_sqrt"]:
            denom = (exp_avg_sq + group["eps"]).sqrt_()
        else:
            denom = exp_avg_sq.sqrt().add_(group["eps"])
        update = exp_avg / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        step_size = group["lr"]
        if group["bias_correction"]:
            step_size = step_size * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        w_norm, u_norm = p.norm(), update.norm()
        ratio = torch.where(
            (w_norm > 0) & (u_norm > 0),
            (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
            torch.ones_like(w_norm),
        )
        p.sub_(update * (ratio * step_size))


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), DeepSpeed's names and defaults.

    Per tensor::

        p = p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Lion update of every parameter with a gradient."""
        loss = _closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            for p in _with_dense_grads(group, "Lion"):
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg, grad = state["exp_avg"], p.grad
                direction = (exp_avg * beta1).add_(grad, alpha=1 - beta1).sign_()
                p.mul_(1 - lr * group["weight_decay"]).add_(direction, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss


def _adam(section: OptimizerConfig, p: AdamParams, params: Iterable[Any]) -> torch.optim.Optimizer:
    if not p.bias_correction:
        raise ValueError(
            "optimizer.params.bias_correction = false is not supported (torch's Adam always "
            "applies bias correction); remove the key"
        )
    cls = torch.optim.AdamW if section.decoupled_weight_decay else torch.optim.Adam
    return cls(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay, amsgrad=p.amsgrad)


def build_optimizer(section: OptimizerConfig, params: Iterable[Any]) -> torch.optim.Optimizer:
    """Create the torch optimizer ``section`` describes over ``params``."""
    p = section.params
    kind = section.type
    if kind in (OptimizerType.ADAM, OptimizerType.ADAMW) and isinstance(p, AdamParams):
        return _adam(section, p, params)
    if kind is OptimizerType.SGD and isinstance(p, SGDParams):
        return torch.optim.SGD(params, **p.model_dump())
    if kind is OptimizerType.ADAGRAD and isinstance(p, AdagradParams):
        return torch.optim.Adagrad(params, **p.model_dump())
    if kind is OptimizerType.LAMB and isinstance(p, LambParams):
        return Lamb(params, **p.model_dump())
    if kind is OptimizerType.LION and isinstance(p, LionParams):
        return Lion(params, **p.model_dump())
    raise TypeError(f"optimizer.params of type {kind.value} is a {type(p).__name__}")


def optimizer_factory(section: OptimizerConfig) -> Callable[[Iterable[Any]], torch.optim.Optimizer]:
    """``params -> optimizer`` for the section (what ``initialize`` hands the partitioned optimizer)."""

    def build(params: Iterable[Any]) -> torch.optim.Optimizer:
        return build_optimizer(section, params)

    return build


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The loss of an optimizer ``closure`` (re-evaluated with grad enabled), or ``None``."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_dense_grads(group: dict[str, Any], name: str) -> Iterator[torch.Tensor]:
    """The parameters of ``group`` that have a gradient; a sparse one is an error naming ``name``."""
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{name} does not support sparse gradients")
        yield p
