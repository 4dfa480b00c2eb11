"""PartitionedOptimizer with optimizer-state offload (zero_offload) on one process.

Exact-kernel offload (cpu and nvme, several sub-groups, two parameter groups) steps the same
numbers as the plain torch optimizer; state_dict / load_state_dict and materialized_state
move the offloaded state in torch's format; unsupported optimizers are refused by name.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_optim_core import OddModel, WholeParams

from zero_offload import AdamKernel, OffloadTarget, OptimizerOffloadConfig
from zero_optim import PartitionedOptimizer


def _make(params):
    return torch.optim.AdamW(
        [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.2}], lr=1e-2, foreach=False
    )


def _step(model, opt, seed):
    x = torch.randn(5, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad() if isinstance(opt, PartitionedOptimizer) else opt.zero_grad(set_to_none=False)
    model(x).backward()
    opt.step()


@pytest.mark.parametrize("device", list(OffloadTarget), ids=lambda d: d.value)
def test_offloaded_partitioned_optimizer_matches_torch_and_round_trips_state(tmp_path, device):
    cfg = OptimizerOffloadConfig(
        device=device,
        nvme_path=tmp_path,
        sub_group_size=100,
        buffer_count=2,
        pipeline_read=True,
        kernel=AdamKernel.EXACT,
    )
    ref = OddModel()
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    ref_opt = _make(list(ref.parameters()))
    model = copy.deepcopy(ref)
    opt = PartitionedOptimizer(model, _make, WholeParams(), offload=cfg)
    assert opt.offload is not None and len(opt.torch_optimizer.state) == 0
    for s in range(4):
        _step(ref, ref_opt, s)
        _step(model, opt, s)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    saved = copy.deepcopy(opt.state_dict())
    assert len(opt.torch_optimizer.state) == 0  # materialized only while saving
    st = saved["torch_optimizer"]["state"]
    assert float(st[1]["step"]) == 4 and st[1]["exp_avg"].numel() == opt.groups[1].numel
    twin = copy.deepcopy(ref)
    twin_opt = PartitionedOptimizer(
        twin, _make, WholeParams(), offload=dataclasses.replace(cfg, nvme_path=tmp_path / "twin")
    )
    twin_opt.load_state_dict(saved)
    assert twin_opt.offload.step_count == 4
    for s in range(4, 6):
        _step(ref, ref_opt, s)
        _step(twin, twin_opt, s)
    for a, b in zip(ref.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    opt.close()
    twin_opt.close()
    assert list(tmp_path.rglob("*.zswap")) == []


def test_offload_refuses_other_optimizers():
    with pytest.raises(TypeError, match="supports torch.optim.Adam and torch.optim.AdamW only, got .*SGD"):
        PartitionedOptimizer(
            OddModel(),
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            WholeParams(),
            offload=OptimizerOffloadConfig(),
        )
