"""``optimizer``: ``{"type": ..., "params": {...}}`` with DeepSpeed's names and defaults, checked per type."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar

from pydantic import model_validator

from zero_full.config.base import Section, TypedSection
from zero_full.config.types import (
    IMPLEMENTED,
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

__all__ = ["AdamParams", "OptimizerConfig", "OptimizerType", "SGDParams"]

_USED = Key(IMPLEMENTED)


class OptimizerType(str, enum.Enum):
    """Optimizers the ``optimizer`` section can describe (``type`` is case-insensitive)."""

    ADAM = "Adam"
    ADAMW = "AdamW"
    SGD = "SGD"


_NO_MAX_GRAD_NORM = Rejected("gradient clipping is the top-level 'gradient_clipping' key (as in DeepSpeed)")
_ADAM_ONLY = UsedWhen("the optimizer type is `Adam`", lambda _, opt: opt.type is OptimizerType.ADAM)


class AdamParams(Section):
    """``optimizer.params`` of ``Adam`` / ``AdamW`` with DeepSpeed's defaults.

    DeepSpeed builds its Adam(W) with ``weight_decay=0.0`` unless told otherwise (torch's
    ``AdamW`` defaults to 0.01): this config follows DeepSpeed, since its users bring
    DeepSpeed configs. Likewise DeepSpeed's ``Adam`` applies *decoupled* weight decay
    (AdamW) unless ``adam_w_mode`` is ``false``; ``AdamW`` always does.
    """

    _PATH = ("optimizer", "params")
    _REJECTED: ClassVar[dict[str, Rejected]] = {"max_grad_norm": _NO_MAX_GRAD_NORM}

    lr: Annotated[Real(0), _USED] = 1e-3
    """Learning rate."""
    betas: Annotated[Betas, _USED] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: Annotated[Real(0), _USED] = 1e-8
    """Term added to the denominator."""
    weight_decay: Annotated[Real(0), _USED] = 0.0
    """Weight decay; DeepSpeed's default 0.0 (torch's ``AdamW`` defaults to 0.01)."""
    amsgrad: Annotated[Flag, _USED] = False
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

    lr: Annotated[Real(0), _USED] = 1e-3
    """Learning rate."""
    momentum: Annotated[Real(0), _USED] = 0.0
    """Momentum factor."""
    dampening: Annotated[Real(0), _USED] = 0.0
    """Dampening of the momentum."""
    weight_decay: Annotated[Real(0), _USED] = 0.0
    """L2 penalty."""
    nesterov: Annotated[Flag, _USED] = False
    """Nesterov momentum (needs ``momentum`` > 0 and ``dampening`` 0)."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "optimizer.params.nesterov = true needs momentum > 0 and dampening = 0, got "
                f"momentum={self.momentum:g}, dampening={self.dampening:g}"
            )
        return self


_PARAMS_BY_TYPE: dict[OptimizerType, type[Section]] = {
    OptimizerType.ADAM: AdamParams,
    OptimizerType.ADAMW: AdamParams,
    OptimizerType.SGD: SGDParams,
}


class OptimizerConfig(TypedSection):
    """``optimizer``: ``{"type": "AdamW", "params": {...}}``; ``params`` is checked per type.

    ``type`` is case-insensitive (``adamw`` = ``AdamW``). :meth:`build` creates the torch
    optimizer the section describes.
    """

    _PATH = ("optimizer",)
    _TYPES = OptimizerType
    _PARAMS_BY_TYPE: ClassVar[dict[OptimizerType, type[Section]]] = _PARAMS_BY_TYPE

    type: Annotated[Choice(OptimizerType), _USED]
    """``Adam``, ``AdamW`` or ``SGD``, any case. ``Adam`` with ``adam_w_mode`` (the default) builds
    ``torch.optim.AdamW``, as DeepSpeed does."""
    params: Annotated[AdamParams | SGDParams, _USED]
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

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the torch optimizer :meth:`build` creates (``params`` excluded)."""
        p = self.params
        if isinstance(p, SGDParams):
            return {
                "lr": p.lr,
                "momentum": p.momentum,
                "dampening": p.dampening,
                "weight_decay": p.weight_decay,
                "nesterov": p.nesterov,
            }
        if not isinstance(p, AdamParams):
            raise TypeError(f"optimizer.params of type {self.type.value} is a {type(p).__name__}")
        return {
            "lr": p.lr,
            "betas": p.betas,
            "eps": p.eps,
            "weight_decay": p.weight_decay,
            "amsgrad": p.amsgrad,
        }

    def build(self, params: Iterable[Any]) -> Any:
        """Create the torch optimizer: ``torch.optim.AdamW``, ``Adam`` or ``SGD``.

        Args:
            params: Parameters or parameter groups, as for any torch optimizer.

        Returns:
            A ``torch.optim.Optimizer``. ``Adam`` with ``adam_w_mode`` (DeepSpeed's default)
            becomes ``torch.optim.AdamW``, as in DeepSpeed.

        Raises:
            ValueError: ``bias_correction = false``, which torch's Adam cannot do.
        """
        import torch  # lazily: the config itself needs only pydantic

        if isinstance(self.params, AdamParams) and not self.params.bias_correction:
            raise ValueError(
                "optimizer.params.bias_correction = false is not supported (torch's Adam always "
                "applies bias correction); remove the key"
            )
        if self.type is OptimizerType.SGD:
            cls = torch.optim.SGD
        else:
            cls = torch.optim.AdamW if self.decoupled_weight_decay else torch.optim.Adam
        return cls(params, **self.torch_kwargs())
