"""``optimizer``: ``{"type": ..., "params": {...}}`` with DeepSpeed's names and defaults, checked per type."""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

from pydantic import model_validator

from zero_full.config.base import Section, TypedSection
from zero_full.config.types import (
    IMPLEMENTED,
    USED,
    Betas,
    Choice,
    Flag,
    Ignored,
    Key,
    Real,
    Refused,
    Rejected,
    UsedWhen,
)

__all__ = [
    "AdagradParams",
    "AdamParams",
    "LambParams",
    "LionParams",
    "OptimizerConfig",
    "OptimizerType",
    "SGDParams",
]


class OptimizerType(str, enum.Enum):
    """Optimizers the ``optimizer`` section can describe (``type`` is case-insensitive)."""

    ADAM = "Adam"
    ADAMW = "AdamW"
    SGD = "SGD"
    ADAGRAD = "Adagrad"
    LAMB = "Lamb"
    LION = "Lion"


_ONE_BIT = (
    "DeepSpeed's 1-bit optimizers compress the gradient all-reduce to 1 bit with error "
    "compensation, a communication scheme zero does not have; use {plain} (the same optimizer "
    "without compression) and, to cut gradient traffic, communication_data_type or ZeRO++'s "
    "zero_quantized_gradients"
)
_MUP = "the muP optimizers (mup package) are not built from the config; pass one to initialize(optimizer=...)"
_REFUSED_TYPES = {
    "OneBitAdam": _ONE_BIT.format(plain='"Adam"'),
    "ZeroOneAdam": _ONE_BIT.format(plain='"Adam"'),
    "OneBitLamb": _ONE_BIT.format(plain='"Lamb"'),
    "MuAdam": _MUP,
    "MuAdamW": _MUP,
    "MuSGD": _MUP,
    "Muon": "zero has no Muon: its orthogonalised update needs whole matrices, not flat partitions; "
    "pass a torch optimizer to initialize(optimizer=...)",
}


_NO_MAX_GRAD_NORM = Rejected("gradient clipping is the top-level 'gradient_clipping' key (as in DeepSpeed)")
_ADAM_ONLY = UsedWhen("the optimizer type is `Adam`", lambda _, opt: opt.type is OptimizerType.ADAM)


class AdamParams(Section):
    """``optimizer.params`` of ``Adam`` / ``AdamW`` with DeepSpeed's defaults."""

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: Annotated[Real(0), USED] = 1e-3
    """Learning rate."""
    betas: Annotated[Betas, USED] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: Annotated[Real(0), USED] = 1e-8
    """Term added to the denominator."""
    weight_decay: Annotated[Real(0), USED] = 0.0
    """Weight decay; DeepSpeed's default 0.0 (torch's ``AdamW`` defaults to 0.01)."""
    amsgrad: Annotated[Flag, USED] = False
    """The AMSGrad variant."""
    adam_w_mode: Annotated[Flag, Key(IMPLEMENTED, when=_ADAM_ONLY)] = True
    """Decoupled weight decay for type ``Adam`` (DeepSpeed's default: true). No effect on ``AdamW``."""
    bias_correction: Annotated[Flag, Key(Refused("Adam without bias correction", supported=True))] = True
    """Adam's bias correction of the running averages (torch's Adam always applies it)."""
    torch_adam: Annotated[Flag, Key(Ignored("zero always uses torch's Adam update"))] = False
    """DeepSpeed's choice between torch's and its fused kernel.

    (DeepSpeed with ``torch_adam: true`` hands ``params`` to torch unchanged, so there a
    missing ``weight_decay`` means torch's 0.01; zero keeps 0.0: give it explicitly.)
    """


class SGDParams(Section):
    """``optimizer.params`` of ``SGD`` (torch's names and defaults)."""

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: Annotated[Real(0), USED] = 1e-3
    """Learning rate."""
    momentum: Annotated[Real(0), USED] = 0.0
    """Momentum factor."""
    dampening: Annotated[Real(0), USED] = 0.0
    """Dampening of the momentum."""
    weight_decay: Annotated[Real(0), USED] = 0.0
    """L2 penalty."""
    nesterov: Annotated[Flag, USED] = False
    """Nesterov momentum (needs ``momentum`` > 0 and ``dampening`` 0)."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "optimizer.params.nesterov = true needs momentum > 0 and dampening = 0, got "
                f"momentum={self.momentum:g}, dampening={self.dampening:g}"
            )
        return self


class AdagradParams(Section):
    """``optimizer.params`` of ``Adagrad`` (torch's ``Adagrad``, as DeepSpeed builds it)."""

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: Annotated[Real(0), USED] = 0.01
    """Learning rate."""
    lr_decay: Annotated[Real(0), USED] = 0.0
    """Learning-rate decay per step: ``lr / (1 + (step - 1) * lr_decay)``."""
    weight_decay: Annotated[Real(0), USED] = 0.0
    """L2 penalty."""
    initial_accumulator_value: Annotated[Real(0), USED] = 0.0
    """Start value of the sum of squared gradients."""
    eps: Annotated[Real(0), USED] = 1e-10
    """Term added to the denominator."""


class LambParams(Section):
    """``optimizer.params`` of ``Lamb`` (DeepSpeed's ``FusedLamb``: names, defaults and update)."""

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {
        "max_grad_norm": _NO_MAX_GRAD_NORM,
        "amsgrad": Rejected("Lamb has no AMSGrad variant (DeepSpeed's FusedLamb refuses it too)"),
    }

    lr: Annotated[Real(0), USED] = 1e-3
    """Learning rate."""
    bias_correction: Annotated[Flag, USED] = True
    """Fold Adam's bias correction into the step size."""
    betas: Annotated[Betas, USED] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: Annotated[Real(0), USED] = 1e-8
    """Term added to the denominator."""
    eps_inside_sqrt: Annotated[Flag, USED] = False
    """Add ``eps`` under the square root (``sqrt(v + eps)``) instead of after it."""
    weight_decay: Annotated[Real(0), USED] = 0.0
    """Weight decay, added to the update before the trust ratio."""
    max_coeff: Annotated[Real(0), USED] = 10.0
    """Upper bound of the trust ratio."""
    min_coeff: Annotated[Real(0), USED] = 0.01
    """Lower bound of the trust ratio."""


class LionParams(Section):
    """``optimizer.params`` of ``Lion`` (DeepSpeed's names and defaults).

    ``p = p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)``, then
    ``m = beta2 * m + (1 - beta2) * g`` (Chen et al. 2023). ``sign(0)`` is 0, as in the paper.
    """

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: Annotated[Real(0), USED] = 1e-3
    """Learning rate."""
    betas: Annotated[Betas, USED] = (0.9, 0.999)
    """Interpolation factor of the update (``beta1``) and of the momentum (``beta2``); DeepSpeed's
    default ``[0.9, 0.999]``."""
    weight_decay: Annotated[Real(0), USED] = 0.0
    """Decoupled weight decay."""


_PARAMS_BY_TYPE: dict[OptimizerType, type[Section]] = {
    OptimizerType.ADAM: AdamParams,
    OptimizerType.ADAMW: AdamParams,
    OptimizerType.SGD: SGDParams,
    OptimizerType.ADAGRAD: AdagradParams,
    OptimizerType.LAMB: LambParams,
    OptimizerType.LION: LionParams,
}


class OptimizerConfig(TypedSection):
    """``optimizer``: ``{"type": "AdamW", "params": {...}}``; ``params`` is checked per type.

    ``type`` is case-insensitive (``adamw`` = ``AdamW``).
    :func:`zero_full.wiring.optimizers.build_optimizer` creates the torch optimizer it describes.
    """

    _PATH = ("optimizer",)
    _TYPES = OptimizerType
    _PARAMS_BY_TYPE: ClassVar[dict[OptimizerType, type[Section]]] = _PARAMS_BY_TYPE
    _REFUSED_TYPES: ClassVar[dict[str, str]] = _REFUSED_TYPES

    type: Annotated[Choice(OptimizerType), USED]
    """``Adam``, ``AdamW``, ``SGD``, ``Adagrad``, ``Lamb`` or ``Lion``, any case. ``Adam`` with
    ``adam_w_mode`` (the default) builds ``torch.optim.AdamW``, as DeepSpeed does. DeepSpeed's 1-bit
    optimizers (``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``), the muP ones and ``Muon`` are
    refused by name, with the reason."""
    params: Annotated[AdamParams | SGDParams | AdagradParams | LambParams | LionParams, USED]
    """The optimizer's keyword arguments, checked for its ``type`` (tables below). Omitted: every
    default."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """Whether weight decay is decoupled (AdamW); DeepSpeed's rule for ``Adam`` is ``adam_w_mode``."""
        if self.type is OptimizerType.ADAMW:
            return True
        return (
            self.type is OptimizerType.ADAM
            and isinstance(self.params, AdamParams)
            and self.params.adam_w_mode
        )
