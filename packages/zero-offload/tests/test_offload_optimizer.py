"""OffloadedOptimizer against torch.optim.AdamW on flat tensors (host memory and swap files)."""

from __future__ import annotations

import itertools

import pytest
import torch

from zero_offload import (
    AdamKernel,
    OffloadedOptimizer,
    OffloadTarget,
    OptimizerOffloadConfig,
    Transfers,
    offload_optimizer_for,
)

SIZES = [1037, 1, 13]  # three groups, odd sizes
PIPES = list(itertools.product([False, True], repeat=2))


def _groups(params):
    return [
        {"params": [params[0]]},
        {"params": [params[1]], "lr": 3e-2},
        {"params": [params[2]], "weight_decay": 0.3},
    ]


def _setup(cfg: OptimizerOffloadConfig):
    gen = torch.Generator().manual_seed(7)
    ref_params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    ref = torch.optim.AdamW(_groups(ref_params), lr=1e-2, foreach=False)
    masters = [p.detach().clone() for p in ref_params]
    grads = [torch.zeros(n) for n in SIZES]
    user = torch.optim.AdamW(_groups([torch.nn.Parameter(m) for m in masters]), lr=1e-2)
    return ref_params, ref, masters, grads, OffloadedOptimizer(user, masters, grads, cfg)


def _steps(ref_params, ref, grads, off, steps, seed=0):
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        for p, g in zip(ref_params, grads):
            new = torch.randn(p.numel(), generator=gen)
            p.grad = new.clone()
            g.copy_(new)
        ref.step()
        off.step()


@pytest.mark.parametrize("device", list(OffloadTarget), ids=lambda d: d.value)
@pytest.mark.parametrize("pipeline_read,pipeline_write", PIPES)
@pytest.mark.smoke
def test_offloaded_steps_are_bit_identical_to_torch_adamw(tmp_path, device, pipeline_read, pipeline_write):
    cfg = OptimizerOffloadConfig(
        device=device,
        nvme_path=tmp_path,
        buffer_count=3,
        pipeline_read=pipeline_read,
        pipeline_write=pipeline_write,
        sub_group_size=100,
        kernel=AdamKernel.EXACT,
    )
    ref_params, ref, masters, grads, off = _setup(cfg)
    assert len(off.subgroups) == 11 + 1 + 1
    _steps(ref_params, ref, grads, off, 4)
    ref.param_groups[0]["lr"] = off.optimizer.param_groups[0]["lr"] = 5e-3  # a scheduler's change
    _steps(ref_params, ref, grads, off, 2, seed=1)
    for p, m in zip(ref_params, masters):
        assert torch.equal(p.detach(), m)
    state = off.export_state()
    for gi, p in enumerate(ref_params):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[gi][k], ref.state[p][k])
        assert float(state[gi]["step"]) == float(ref.state[p]["step"]) == 6
    t = off.transfers
    assert t.steps == 6
    assert t.grad_down == t.param_up == Transfers(6 * 13, 6 * sum(SIZES) * 4)
    if device is OffloadTarget.NVME:
        assert off.resident_state_bytes == off._store.pool.resident_bytes  # noqa: SLF001
        assert len(list((tmp_path / "zero_rank0" / "optimizer").glob("*.zswap"))) == 13 * 3
    off.close()
    assert list(tmp_path.rglob("*.zswap")) == []


@pytest.mark.parametrize("device", list(OffloadTarget), ids=lambda d: d.value)
@pytest.mark.smoke
def test_import_then_continue_equals_uninterrupted(tmp_path, device):
    """export -> new optimizer -> import -> steps equals the same steps without the round trip."""
    cfg = OptimizerOffloadConfig(
        device=device, nvme_path=tmp_path / "a", sub_group_size=64, kernel=AdamKernel.EXACT
    )
    ref_params, ref, masters, grads, off = _setup(cfg)
    _steps(ref_params, ref, grads, off, 3)
    saved = off.export_state()
    cfg2 = OptimizerOffloadConfig(
        device=device, nvme_path=tmp_path / "b", sub_group_size=50, kernel=AdamKernel.EXACT
    )
    masters2 = [m.clone() for m in masters]
    user2 = torch.optim.AdamW(_groups([torch.nn.Parameter(m) for m in masters2]), lr=1e-2)
    off2 = OffloadedOptimizer(user2, masters2, grads, cfg2)
    off2.import_state(saved)
    assert off2.step_count == 3
    _steps(ref_params, ref, grads, off2, 2)
    for p, m in zip(ref_params, masters2):
        assert torch.equal(p.detach(), m)
    with pytest.raises(ValueError, match="2 saved optimizer groups"):
        off2.import_state(saved[:2])
    off.close()
    off2.close()


def test_config_is_checked(tmp_path):
    with pytest.raises(ValueError, match="need at least 3 buffers"):
        OptimizerOffloadConfig(
            OffloadTarget.NVME, tmp_path, buffer_count=2, pipeline_read=True, pipeline_write=True
        )
    with pytest.raises(ValueError, match="needs nvme_path"):
        OptimizerOffloadConfig(OffloadTarget.NVME, None)
    with pytest.raises(ValueError, match="sub_group_size"):
        OptimizerOffloadConfig(sub_group_size=0)
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match="SGD"):
        OffloadedOptimizer(
            torch.optim.SGD([p], lr=1.0), [p.detach()], [torch.zeros(3)], OptimizerOffloadConfig()
        )


@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_every_offload_wants_one_master_and_gradient_per_group(optimizer_class, ratio):
    """Fast path, host twin and partial offload alike refuse masters that do not match the groups."""
    p = torch.nn.Parameter(torch.zeros(5))
    user = optimizer_class([p], lr=0.1)
    config = OptimizerOffloadConfig(sub_group_size=2, ratio=ratio)
    two = [torch.zeros(5), torch.zeros(3)]
    with pytest.raises(ValueError, match="2 masters and 2 gradients for 1 param groups"):
        offload_optimizer_for(user, [t.clone() for t in two], two, config)
    with pytest.raises(ValueError, match="1 masters and 2 gradients for 1 param groups"):
        offload_optimizer_for(user, two[:1], two, config)
