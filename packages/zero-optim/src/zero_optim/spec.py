"""The user's optimizer, as a callable or a torch optimizer, turned into parameter groups.

A user hands over either ``optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)``
(called once with the model's parameters) or an already built torch optimizer without
state. Either way the torch optimizer is built over the *model's* parameters, which keeps
every per-group option the user set (learning rate, weight decay, betas, ...). The
partitioned optimizer then re-maps each of its ``param_groups`` onto that group's flat
master tensor (:func:`remap_onto_flat`), so the same optimizer object, with the same group
dicts (an LR scheduler built on it keeps working), steps one tensor per group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

# Import dynamo now, normally before the user calls init_process_group: torch builds an
# optimizer by importing torch._dynamo, and that import, once a process group exists, keeps
# references to torch's default group that outlive destroy_process_group(); gloo then aborts
# the process at exit ("terminate called without an active exception") now and then.
# Imported before the group exists, it keeps none.
import torch._dynamo  # noqa: F401, E402 - for its side effect, see above
from torch import nn

import zero_params
from zero_offload import twin_optimizer

__all__ = [
    "OptimizerSpec",
    "build_torch_optimizer",
    "default_optimizer",
    "remap_onto_flat",
    "trainable_groups",
]

OptimizerSpec = Callable[[list[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer | None
"""What ``initialize(optimizer=...)`` accepts: a callable, a torch optimizer, or ``None`` (AdamW)."""


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer used when none is given: ``torch.optim.AdamW`` with torch's defaults."""
    return torch.optim.AdamW(params)


def build_torch_optimizer(spec: OptimizerSpec, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """Build (or validate) the torch optimizer over the model's parameters."""
    if spec is None:
        spec = default_optimizer
    built_here = False
    if isinstance(spec, torch.optim.Optimizer):
        opt = spec
    elif callable(spec):
        built_here = True
        opt = _build_over_stand_ins(spec, list(params))
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable returned a {type(opt).__name__}, not a torch.optim.Optimizer; "
                "pass e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
            )
    else:
        raise TypeError(
            f"optimizer must be a callable, a torch.optim.Optimizer or None, got {type(spec).__name__}; "
            "pass e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    if isinstance(opt, torch.optim.LBFGS):
        raise ValueError(
            "torch.optim.LBFGS cannot drive a partitioned optimizer (its step re-evaluates a closure "
            "over full parameters); use a first-order optimizer such as AdamW or SGD"
        )
    if len(opt.state) > 0 and not built_here:  # state made by a constructor we ran (Adagrad) is re-made
        raise ValueError(
            f"the {type(opt).__name__} passed as optimizer already has state for {len(opt.state)} "
            "tensor(s); pass a fresh optimizer (or a callable that builds one), state cannot be re-mapped"
        )
    return opt


def _build_over_stand_ins(spec: Callable[..., Any], params: list[nn.Parameter]) -> Any:
    """Call ``spec`` with ``meta`` stand-ins for partitioned parameters, then put the real ones back.

    A constructor that makes per-parameter state (Adagrad's ``sum = full_like(p)``) cannot
    touch a partitioned parameter; on a ``meta`` stand-in of its full shape it allocates
    nothing, and :func:`remap_onto_flat` makes that state again for the flat masters.
    """
    stand = {
        id(p): nn.Parameter(
            torch.empty(zero_params.full_shape(p), dtype=p.dtype, device="meta"),
            requires_grad=p.requires_grad,
        )
        for p in params
        if zero_params.is_partitioned(p)
    }
    if not stand:
        return spec(params)
    opt = spec([stand.get(id(p), p) for p in params])
    if not isinstance(opt, torch.optim.Optimizer):
        return opt
    back = {id(stand[id(p)]): p for p in params if id(p) in stand}
    for group in opt.param_groups:
        group["params"] = [back.get(id(q), q) for q in group["params"]]
    for q in list(opt.state):
        if id(q) in back:
            opt.state[back[id(q)]] = opt.state.pop(q)
    return opt


def trainable_groups(
    opt: torch.optim.Optimizer, model_params: Iterable[nn.Parameter]
) -> list[list[nn.Parameter]]:
    """The trainable parameters of each of ``opt``'s groups, checked against the model.

    Parameters with ``requires_grad=False`` are left out (they never get a gradient and
    torch would never step them).
    """
    known = {id(p) for p in model_params}
    groups: list[list[nn.Parameter]] = []
    for gi, group in enumerate(opt.param_groups):
        kept: list[nn.Parameter] = []
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                    "of the model; build the optimizer over the model's parameters"
                )
            if p.requires_grad:
                kept.append(p)
        groups.append(kept)
    return groups


def remap_onto_flat(opt: torch.optim.Optimizer, masters: Sequence[torch.Tensor]) -> None:
    """Point each of ``opt``'s groups at its one flat master tensor (options untouched)."""
    if len(masters) != len(opt.param_groups):
        raise ValueError(f"{len(masters)} flat tensors for {len(opt.param_groups)} param groups")
    for group, master in zip(opt.param_groups, masters):
        group["params"] = [master]
    if opt.state:
        # state its constructor created (e.g. Adagrad's ``sum``): made again for the flat masters
        # by a fresh instance of the same class with the same options
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [m]}
            for g, m in zip(opt.param_groups, masters)
        ]
        fresh = twin_optimizer(opt, groups)
        opt.state.clear()
        for master in masters:
            if master in fresh.state:
                opt.state[master] = fresh.state[master]
