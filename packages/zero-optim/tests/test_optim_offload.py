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

from zero_offload import AdamKernel, HostOptimizer, OffloadTarget, OptimizerOffloadConfig, PartialOffload
from zero_optim import PartitionedOptimizer


def _make(params):
    return torch.optim.AdamW(
        [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.2}], lr=1e-2, foreach=False
    )


def _twins(make, cfg):
    """The reference: a model and its torch optimizer (zero gradients); a copy under an offloaded one."""
    ref = OddModel()
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    model = copy.deepcopy(ref)
    opt = PartitionedOptimizer(model, make, WholeParams(), offload=cfg)
    return ref, make(list(ref.parameters())), model, opt


def _train_both(ref, ref_opt, model, opt, seeds: range) -> None:
    """Step the reference and the offloaded copy on the same batches: their parameters stay equal."""
    for s in seeds:
        _step(ref, ref_opt, s)
        _step(model, opt, s)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


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
    ref, ref_opt, model, opt = _twins(_make, cfg)
    assert opt.offload is not None and len(opt.torch_optimizer.state) == 0
    _train_both(ref, ref_opt, model, opt, range(4))
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
    _train_both(ref, ref_opt, twin, twin_opt, range(4, 6))
    opt.close()
    twin_opt.close()
    assert list(tmp_path.rglob("*.zswap")) == []


OTHER_OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(
        [{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.1}], lr=0.05, momentum=0.9, nesterov=True
    ),
    "adagrad": lambda ps: torch.optim.Adagrad(
        [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.02}], lr=0.05, initial_accumulator_value=0.1
    ),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("name", list(OTHER_OPTIMIZERS))
def test_any_torch_optimizer_is_offloaded_to_host_and_steps_as_torch_does(name):
    make = OTHER_OPTIMIZERS[name]
    ref, ref_opt, model, opt = _twins(make, OptimizerOffloadConfig())
    assert isinstance(opt.offload, HostOptimizer) and len(opt.torch_optimizer.state) == 0
    for s in range(3):
        _step(ref, ref_opt, s)
        _step(model, opt, s)
    opt.param_groups[0]["lr"] *= 0.5  # a scheduler's change reaches the host twin
    for g in ref_opt.param_groups[:1]:
        g["lr"] *= 0.5
    _step(ref, ref_opt, 3)
    _step(model, opt, 3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert opt.offload.host_optimizer.state  # the state lives on the host twin
    saved = copy.deepcopy(opt.state_dict())  # torch's format, as without offload
    twin = copy.deepcopy(ref)
    twin_opt = PartitionedOptimizer(twin, make, WholeParams(), offload=OptimizerOffloadConfig())
    twin_opt.load_state_dict(saved)
    _train_both(ref, ref_opt, twin, twin_opt, range(4, 6))


def test_nvme_offload_of_other_optimizers_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"nvme swaps Adam / AdamW state only, got torch\.optim\.sgd\.SGD"):
        PartitionedOptimizer(
            OddModel(),
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            WholeParams(),
            offload=OptimizerOffloadConfig(device=OffloadTarget.NVME, nvme_path=tmp_path),
        )


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_partial_offload_matches_torch_and_round_trips_state(name):
    make = _make if name == "adamw" else OTHER_OPTIMIZERS[name]
    cfg = OptimizerOffloadConfig(sub_group_size=7, ratio=0.5, kernel=AdamKernel.EXACT)
    ref, ref_opt, model, opt = _twins(make, cfg)
    assert isinstance(opt.offload, PartialOffload)
    total = sum(g.master.numel() for g in opt.groups)
    assert opt.offload.offloaded_numel + opt.offload.device_numel == total
    assert 0 < opt.offload.offloaded_numel < total
    _train_both(ref, ref_opt, model, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())  # one torch-format state over each whole master
    key = "exp_avg" if name == "adamw" else "momentum_buffer"
    assert saved["torch_optimizer"]["state"][0][key].numel() == opt.groups[0].numel
    twin = copy.deepcopy(ref)
    twin_opt = PartitionedOptimizer(twin, make, WholeParams(), offload=cfg)
    twin_opt.load_state_dict(saved)
    _train_both(ref, ref_opt, twin, twin_opt, range(3, 5))
