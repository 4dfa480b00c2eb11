"""CpuAdam against torch.optim.Adam / AdamW on flat tensors.

* ``EXACT``: bit-identical to ``torch.optim.Adam(W)(foreach=False)`` over several steps, with
  and without weight decay, decoupled or L2, maximize, odd lengths (block boundaries).
* ``FUSED``: within float rounding: every element within 1e-6 relative to the tensor's
  largest magnitude of torch's per-tensor result after 10 steps (measured: ~1e-7).
"""

from __future__ import annotations

import pytest
import torch

from zero_offload import AdamKernel, CpuAdam, adam_hyper_from_group, check_offloadable

SIZES = [0, 1, 7, 1023, (1 << 16) + 3]


def _run(cls, kernel: AdamKernel | None, numel: int, steps: int, **opts) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) for _ in range(steps)]
    p = torch.nn.Parameter(start.clone())
    opt = cls([p], foreach=False, **opts)
    if kernel is None:
        for g in grads:
            p.grad = g.clone()
            opt.step()
        st = opt.state[p] if numel else {"exp_avg": torch.zeros(0), "exp_avg_sq": torch.zeros(0)}
        return p.detach(), st["exp_avg"], st["exp_avg_sq"]
    adam = CpuAdam(kernel)
    hyper = adam_hyper_from_group(opt, opt.param_groups[0])
    m, v, x = torch.zeros(numel), torch.zeros(numel), start.clone()
    for i, g in enumerate(grads, start=1):
        adam.step(x, g.clone(), m, v, i, hyper)
    assert adam.elements_stepped == numel * steps
    return x, m, v


OPTS = [
    (torch.optim.AdamW, {"lr": 1e-2}),
    (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "decoupled_weight_decay": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "maximize": True}),
]


def _over_settings(test):
    """Parametrize ``test`` over every optimizer setting of :data:`OPTS` and size of :data:`SIZES`."""
    ids = [f"{c.__name__}-{i}" for i, (c, _) in enumerate(OPTS)]
    return pytest.mark.parametrize("numel", SIZES)(pytest.mark.parametrize("cls,opts", OPTS, ids=ids)(test))


def _kernel_and_torch(cls, opts, numel, kernel, steps):
    """(kernel's, torch's, name) for the parameter, exp_avg and exp_avg_sq after ``steps`` steps."""
    got, ref = _run(cls, kernel, numel, steps, **opts), _run(cls, None, numel, steps, **opts)
    return zip(got, ref, ("param", "exp_avg", "exp_avg_sq"))


@_over_settings
def test_exact_kernel_is_bit_identical_to_torch(cls, opts, numel):
    for a, b, what in _kernel_and_torch(cls, opts, numel, AdamKernel.EXACT, 6):
        assert torch.equal(a, b), f"{what} differs: max {(a - b).abs().max()}"


@_over_settings
def test_fused_kernel_is_within_float_rounding_of_torch(cls, opts, numel):
    for a, b, what in _kernel_and_torch(cls, opts, numel, AdamKernel.FUSED, 10):
        if numel:
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err <= 1e-6, f"{what}: relative error {err:.2e}"


def test_hyperparameters_follow_the_group_and_bad_input_is_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=0.5, betas=(0.7, 0.8), eps=1e-3, weight_decay=0.2)
    opt.param_groups[0]["lr"] = 0.25  # e.g. an LR scheduler
    h = adam_hyper_from_group(opt, opt.param_groups[0])
    assert (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled) == (0.25, 0.7, 0.8, 1e-3, 0.2, True)
    assert not adam_hyper_from_group(opt, {**opt.param_groups[0]}).maximize
    with pytest.raises(TypeError, match=r"got torch\.optim\.sgd\.SGD"):
        check_offloadable(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        check_offloadable(torch.optim.Adam([p], amsgrad=True))
    with pytest.raises(ValueError, match="1-D fp32 CPU"):
        CpuAdam().step(torch.zeros(3), torch.zeros(4), torch.zeros(3), torch.zeros(3), 1, h)
    with pytest.raises(ValueError, match="start at 1"):
        CpuAdam().step(*(torch.zeros(3) for _ in range(4)), 0, h)
