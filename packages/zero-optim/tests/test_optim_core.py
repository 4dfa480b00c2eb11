"""The partitioned-optimizer core on one process: flat layout, one step == torch, groups, accumulation.

The core is exercised through a whole-parameter partitioning (this process owns every
element; ``param.data`` and ``param.grad`` are views of the flat buffers), so autograd fills
the flat gradient buffer directly and results compare against plain torch optimizers.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from zero_optim import FlatGroup, PartitionedOptimizer

SIZES = [(0,), (1,), (7,), (3, 5), (1023,), (13, 11)]


class WholeParams:
    """Test partitioning: whole parameters, data and grad as views of the flat buffers."""

    def local_numel(self, param):
        return param.numel()

    def load(self, param, master):
        master.copy_(param.detach().reshape(-1))

    def bind(self, param, working, grad):
        param.data = working.view(param.shape)
        param.grad = grad.view(param.shape)

    def after_step(self, groups):
        pass


class OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(*s, generator=g)) for s in SIZES)

    def forward(self, x):
        total = x.sum() * 0
        for i, p in enumerate(self.ps):
            total = total + ((p * (i + 1) - x.mean()) ** 2).sum() + p.sum() ** 3 * 1e-3
        return total


def _pair(make_opt):
    ref = OddModel()
    model = copy.deepcopy(ref)
    opt = PartitionedOptimizer(model, make_opt, WholeParams())
    return ref, make_opt(list(ref.parameters())), model, opt


def _train(model, opt, steps, accumulate=1, zero=None):
    for step in range(steps):
        for micro in range(accumulate):
            x = torch.full((4,), float(step + micro) / 10)
            model(x).backward()
        opt.step()
        (zero or opt.zero_grad)()


def test_layout_is_contiguous_and_params_are_views_of_the_master():
    model = OddModel()
    values = [p.detach().clone() for p in model.parameters()]
    opt = PartitionedOptimizer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), WholeParams())
    (group,) = opt.groups
    assert group.numel == sum(v.numel() for v in values)
    offset = 0
    for seg, p, v in zip(group.segments, model.parameters(), values):
        assert (seg.offset, seg.numel, seg.param) == (offset, v.numel(), p)
        assert torch.equal(group.master_view(seg), v.reshape(-1))
        if seg.numel:
            assert p.data_ptr() == group.master.data_ptr() + 4 * offset
            assert p.grad.data_ptr() == group.grad.data_ptr() + 4 * offset
        offset += seg.numel
    assert group.working is group.master
    assert group.master.grad is group.grad
    assert opt.torch_optimizer.param_groups[0]["params"] == [group.master]


def test_low_precision_working_copy_is_refreshed_after_the_step():
    p = nn.Parameter(torch.arange(5.0))
    group = FlatGroup([p], ["p"], [5], torch.device("cpu"), working_dtype=torch.bfloat16)
    group.master.copy_(torch.arange(5.0) * 1.5)
    assert group.working.dtype == torch.bfloat16 and group.working is not group.master
    group.publish()
    assert torch.equal(group.working, (torch.arange(5.0) * 1.5).to(torch.bfloat16))


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    ],
    ids=["adamw", "sgd-nesterov", "adam-amsgrad", "rmsprop"],
)
@pytest.mark.smoke
def test_one_flat_step_equals_the_torch_optimizer_over_each_parameter(make_opt):
    ref, ref_opt, model, opt = _pair(make_opt)
    _train(ref, ref_opt, 5, zero=lambda: ref_opt.zero_grad(set_to_none=False))
    _train(model, opt, 5)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_param_group_options_are_preserved():
    def make(ps):
        return torch.optim.AdamW(
            [{"params": ps[:3], "lr": 1e-1, "weight_decay": 0.0}, {"params": ps[3:], "betas": (0.5, 0.6)}],
            lr=1e-2,
        )

    ref, ref_opt, model, opt = _pair(make)
    assert len(opt.groups) == 2
    assert [len(g.segments) for g in opt.groups] == [3, len(SIZES) - 3]
    groups = opt.param_groups
    assert (groups[0]["lr"], groups[0]["weight_decay"], groups[0]["betas"]) == (1e-1, 0.0, (0.9, 0.999))
    assert (groups[1]["lr"], groups[1]["weight_decay"], groups[1]["betas"]) == (1e-2, 0.01, (0.5, 0.6))
    _train(ref, ref_opt, 4, zero=lambda: ref_opt.zero_grad(set_to_none=False))
    _train(model, opt, 4)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_optimizer_instance_is_remapped_and_an_lr_change_applies():
    model = OddModel()
    ref = copy.deepcopy(model)
    inst = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.5)
    opt = PartitionedOptimizer(model, inst, WholeParams())
    assert opt.torch_optimizer is inst
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3, momentum=0.5)
    sched = torch.optim.lr_scheduler.StepLR(inst, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(3):
        x = torch.full((4,), float(step))
        model(x).backward()
        ref(x).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad(set_to_none=False)
        sched.step()
        ref_sched.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gradients_accumulate_across_micro_steps_until_zero_grad():
    ref, ref_opt, model, opt = _pair(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))
    _train(ref, ref_opt, 3, accumulate=3, zero=lambda: ref_opt.zero_grad(set_to_none=False))
    _train(model, opt, 3, accumulate=3)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    model(torch.ones(4)).backward()
    assert opt.groups[0].grad.abs().sum() > 0
    opt.zero_grad()
    assert opt.groups[0].grad.abs().sum() == 0
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())


def test_frozen_parameters_stay_out_of_the_flat_buffers():
    model = OddModel()
    model.ps[1].requires_grad_(False)
    frozen = model.ps[1].detach().clone()
    opt = PartitionedOptimizer(model, None, WholeParams())
    assert isinstance(opt.torch_optimizer, torch.optim.AdamW)
    assert [s.name for s in opt.groups[0].segments] == [f"ps.{i}" for i in range(len(SIZES)) if i != 1]
    model(torch.ones(4)).backward()
    opt.step()
    assert torch.equal(model.ps[1], frozen)


@pytest.mark.smoke
def test_state_dict_round_trip_continues_identically():
    def make(ps):
        return torch.optim.AdamW(ps, lr=1e-2)

    model = OddModel()
    opt = PartitionedOptimizer(model, make, WholeParams())
    _train(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    _train(model, opt, 2)
    expected = [p.detach().clone() for p in model.parameters()]

    other = OddModel()
    other_opt = PartitionedOptimizer(other, make, WholeParams())
    other_opt.load_state_dict(saved)
    _train(other, other_opt, 2)
    for a, b in zip(other.parameters(), expected):
        assert torch.equal(a, b)


def test_state_tensors_replaced_between_steps_are_the_ones_stepped():
    """The stepper keeps its views of the flat state between steps; replaced tensors are seen."""

    def make(ps):
        return torch.optim.AdamW(ps, lr=1e-2)

    ref = OddModel()
    model = copy.deepcopy(ref)
    ref_opt = make(list(ref.parameters()))
    opt = PartitionedOptimizer(model, make, WholeParams(), sub_group_size=400)  # several ranges
    _train(ref, ref_opt, 2, zero=lambda: ref_opt.zero_grad(set_to_none=False))
    _train(model, opt, 2)
    state = opt.torch_optimizer.state[opt.groups[0].master]
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = state[key].clone()  # same values, new tensors
    _train(ref, ref_opt, 3, zero=lambda: ref_opt.zero_grad(set_to_none=False))
    _train(model, opt, 3)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    moments = torch.cat([ref_opt.state[p]["exp_avg"].reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(state["exp_avg"], moments, rtol=1e-6, atol=1e-9)


def test_loading_a_state_dict_releases_the_replaced_state():
    def make(ps):
        return torch.optim.AdamW(ps, lr=1e-2)

    model = OddModel()
    opt = PartitionedOptimizer(model, make, WholeParams(), sub_group_size=400)
    _train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    old = weakref.ref(opt.torch_optimizer.state[opt.groups[0].master]["exp_avg"])
    opt.load_state_dict(saved)
    gc.collect()
    assert old() is None, "the stepper still holds the optimizer state that loading replaced"


def test_state_dict_of_another_layout_is_refused():
    opt = PartitionedOptimizer(OddModel(), None, WholeParams())
    saved = opt.state_dict()
    saved["layout"][0][2] = ("ps.2", 8)
    with pytest.raises(ValueError, match=r"entry 2: saved \(name, numel\) \('ps.2', 8\), here \('ps.2', 7\)"):
        opt.load_state_dict(saved)


def test_bad_optimizers_are_refused_with_the_fix():
    model = OddModel()
    other = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="lambda params"):
        PartitionedOptimizer(model, "adamw", WholeParams())
    with pytest.raises(TypeError, match="returned a list"):
        PartitionedOptimizer(model, lambda ps: ps, WholeParams())
    with pytest.raises(ValueError, match="not a parameter of the model"):
        PartitionedOptimizer(model, lambda ps: torch.optim.SGD(other.parameters(), lr=1), WholeParams())
    used = torch.optim.AdamW(model.parameters())
    model(torch.ones(4)).backward()
    used.step()
    with pytest.raises(ValueError, match="already has state"):
        PartitionedOptimizer(model, used, WholeParams())
    with pytest.raises(ValueError, match="LBFGS"):
        PartitionedOptimizer(model, lambda ps: torch.optim.LBFGS(ps), WholeParams())
