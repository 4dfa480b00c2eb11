"""The ``optimizer`` section's types: Lamb and Lion against an element-by-element reference of the
published update, Adagrad as torch's, the refused DeepSpeed types named, and training through the engine."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import zero_full
from zero_full.config.zero_config import ZeroConfig
from zero_full.wiring.optimizers import Lamb, Lion, build_optimizer

SHAPES = [(3, 5), (7,), (1, 1), (2, 3, 4)]
STEPS = 5


def _params_and_grads(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    grads[1][1][2] = 0.0  # a zero gradient element (Lion: sign of 0 at the first steps' momentum)
    params[2].zero_()  # a zero tensor (Lamb: trust ratio 1)
    return params, grads


def _run(make, seed: int) -> list[torch.Tensor]:
    params, grads = _params_and_grads(seed)
    leaves = [nn.Parameter(p.clone()) for p in params]
    opt = make(leaves)
    for step_grads in grads:
        for leaf, grad in zip(leaves, step_grads, strict=True):
            leaf.grad = grad.clone()
        opt.step()
    return [leaf.detach() for leaf in leaves]


def _lamb_reference(p, grads, lr, betas, eps, wd, bias_correction, eps_inside_sqrt, max_coeff, min_coeff):
    """LAMB as DeepSpeed's FusedLamb kernel computes it, one python float at a time."""
    b1, b2 = betas
    w = p.flatten().tolist()
    m, v = [0.0] * len(w), [0.0] * len(w)
    for t, grad in enumerate(grads, start=1):
        g = grad.flatten().tolist()
        u = []
        for j in range(len(w)):
            m[j] = b1 * m[j] + (1 - b1) * g[j]
            v[j] = b2 * v[j] + (1 - b2) * g[j] * g[j]
            denom = math.sqrt(v[j] + eps) if eps_inside_sqrt else math.sqrt(v[j]) + eps
            u.append(m[j] / denom + wd * w[j])
        w_norm, u_norm = math.sqrt(sum(x * x for x in w)), math.sqrt(sum(x * x for x in u))
        ratio = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm and u_norm else 1.0
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
        w = [w[j] - step_size * ratio * u[j] for j in range(len(w))]
    return torch.tensor(w, dtype=torch.float64).reshape(p.shape)


def _lion_reference(p, grads, lr, betas, wd):
    """Lion (Chen et al. 2023, Algorithm 2), one python float at a time."""
    b1, b2 = betas
    w, m = p.flatten().tolist(), [0.0] * p.numel()
    for grad in grads:
        g = grad.flatten().tolist()
        for j in range(len(w)):
            c = b1 * m[j] + (1 - b1) * g[j]
            sign = (c > 0) - (c < 0)
            w[j] = w[j] * (1 - lr * wd) - lr * sign
            m[j] = b2 * m[j] + (1 - b2) * g[j]
    return torch.tensor(w, dtype=torch.float64).reshape(p.shape)


LAMB_CASES = [
    {},
    {"lr": 0.01, "weight_decay": 0.1, "betas": [0.8, 0.99]},
    {"lr": 0.05, "eps_inside_sqrt": True, "bias_correction": False, "eps": 1e-6},
    {"lr": 0.02, "max_coeff": 0.3, "min_coeff": 0.2, "weight_decay": 0.01},  # the clamp bites
]


@pytest.mark.parametrize("params", LAMB_CASES)
def test_lamb_follows_the_fused_lamb_update(params):
    section = ZeroConfig.model_validate({"optimizer": {"type": "Lamb", "params": params}}).optimizer
    ours = _run(lambda ps: build_optimizer(section, ps), seed=3)
    p = section.params
    start, grads = _params_and_grads(3)
    for i, shape in enumerate(SHAPES):
        per_tensor = [step[i] for step in grads]
        expected = _lamb_reference(
            start[i], per_tensor, p.lr, p.betas, p.eps, p.weight_decay,
            p.bias_correction, p.eps_inside_sqrt, p.max_coeff, p.min_coeff,
        )  # fmt: skip
        assert ours[i].shape == shape
        torch.testing.assert_close(ours[i], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("params", [{}, {"lr": 0.01, "weight_decay": 0.3, "betas": [0.95, 0.98]}])
def test_lion_follows_the_published_update(params):
    section = ZeroConfig.model_validate({"optimizer": {"type": "lion", "params": params}}).optimizer
    assert isinstance(build_optimizer(section, [nn.Parameter(torch.zeros(1))]), Lion)
    ours = _run(lambda ps: build_optimizer(section, ps), seed=5)
    p = section.params
    start, grads = _params_and_grads(5)
    for i in range(len(SHAPES)):
        expected = _lion_reference(start[i], [step[i] for step in grads], p.lr, p.betas, p.weight_decay)
        torch.testing.assert_close(ours[i], expected, rtol=1e-12, atol=1e-12)


def test_adagrad_is_torchs_with_deepspeeds_names():
    params = {
        "lr": 0.05,
        "lr_decay": 0.01,
        "weight_decay": 0.02,
        "initial_accumulator_value": 0.1,
        "eps": 1e-9,
    }
    section = ZeroConfig.model_validate({"optimizer": {"type": "Adagrad", "params": params}}).optimizer
    ours = _run(lambda ps: build_optimizer(section, ps), seed=7)
    theirs = _run(lambda ps: torch.optim.Adagrad(ps, **params), seed=7)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert section.params.model_dump() == params
    defaults = ZeroConfig.model_validate({"optimizer": {"type": "adagrad"}}).optimizer.params
    assert (defaults.lr, defaults.eps) == (0.01, 1e-10)


def test_lamb_and_lion_defaults_are_deepspeeds():
    lamb = build_optimizer(
        ZeroConfig.model_validate({"optimizer": {"type": "LAMB"}}).optimizer, [nn.Parameter(torch.ones(2))]
    )
    assert isinstance(lamb, Lamb)
    group = lamb.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["max_coeff"], group["min_coeff"]) == (
        1e-3, (0.9, 0.999), 1e-8, 10.0, 0.01,
    )  # fmt: skip
    lion = ZeroConfig.model_validate({"optimizer": {"type": "Lion"}}).optimizer.params
    assert (lion.lr, lion.betas, lion.weight_decay) == (1e-3, (0.9, 0.999), 0.0)


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("OneBitAdam", ["optimizer.type = 'OneBitAdam'", "1-bit", '"Adam"']),
        ("ZeroOneAdam", ["optimizer.type = 'ZeroOneAdam'", "1-bit"]),
        ("onebitlamb", ["optimizer.type = 'onebitlamb'", "1-bit", '"Lamb"']),
        ("MuAdamW", ["muP", "initialize(optimizer=...)"]),
    ],
)
def test_refused_deepspeed_optimizers_are_named_with_the_reason(kind, words):
    with pytest.raises(ValidationError) as err:
        ZeroConfig.model_validate({"optimizer": {"type": kind, "params": {"lr": 1e-3, "freeze_step": 10}}})
    text = str(err.value)
    assert all(w in text for w in words), text
    assert "freeze_step" not in text  # the type is the culprit, not its params


def test_lamb_params_are_checked():
    with pytest.raises(ValidationError, match=r"optimizer\.params\.amsgrad.*AMSGrad"):
        ZeroConfig.model_validate({"optimizer": {"type": "Lamb", "params": {"amsgrad": True}}})
    with pytest.raises(ValidationError, match=r"optimizer\.params\.momentum"):
        ZeroConfig.model_validate({"optimizer": {"type": "Lion", "params": {"momentum": 0.9}}})


def _model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(3 * world, 5, generator=g), torch.randn(3 * world, 3, generator=g)


OPTIM = {"type": "Lion", "params": {"lr": 0.01, "weight_decay": 0.1}}


def _train(rank, stage: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 3, "optimizer": OPTIM, "zero_optimization": {"stage": stage}}
    engine = zero_full.initialize(_model(), config)
    try:
        for step in range(4):
            x, y = _batch(step, rank.world_size)
            mine = slice(3 * rank.rank, 3 * (rank.rank + 1))
            engine.backward((engine(x[mine]) - y[mine]).square().mean())
            engine.step()
        return engine.consolidated_state_dict()
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_lion_from_the_config_trains_like_a_single_process(dist, stage):
    weights = dist.run(2, _train, stage)[0]
    model = _model()
    opt = build_optimizer(ZeroConfig.model_validate({"optimizer": OPTIM}).optimizer, model.parameters())
    for step in range(4):
        x, y = _batch(step, 2)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6)
