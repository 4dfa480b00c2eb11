"""initialize's device: the model moved to it, a mismatch refused with the parameter named.

Process groups of one rank in this process (``cpu:gloo`` serves the CPU alone) and, for a group
that serves only CUDA as NCCL does, torch's fake backend at world 2 (no data moves).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import zero_full
from zero_full.wiring.placement import engine_device, place_model

CONFIG = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


class Net(nn.Module):
    def __init__(self, b_device="cpu"):
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 2, device=b_device)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


@pytest.fixture
def cpu_group():
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cuda_only_group():
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_the_default_device_is_the_cpu_when_the_group_serves_no_accelerator_here(cpu_group):
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    engine = zero_full.initialize(model, CONFIG)
    try:
        assert engine.device == torch.device("cpu")
        x = torch.randn(4, 5)
        engine.backward(engine(x))
        engine.step()
        reference(x).backward()  # one SGD step by hand: the engine trained where it said
        with torch.no_grad():
            expected = {n: p - 0.1 * p.grad for n, p in reference.named_parameters()}
        got = engine.consolidated_state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value)
    finally:
        engine.close()


def test_a_device_the_group_does_not_serve_is_refused(cpu_group):
    with pytest.raises(ValueError, match=r"initialize\(device='meta'\): the process group serves only cpu"):
        engine_device("meta")
    assert engine_device("cpu") == torch.device("cpu")


def test_a_model_on_two_devices_is_refused_naming_one_parameter_on_each(cpu_group):
    with pytest.raises(ValueError) as info:
        zero_full.initialize(Net(b_device="meta"), CONFIG)
    message = str(info.value)
    assert "on 2 devices ('a.weight' on cpu, 'b.weight' on meta)" in message, message


def test_a_model_without_values_is_refused(cpu_group):
    model = Net(b_device="meta").to("meta")
    with pytest.raises(ValueError, match=r"parameter 'a.weight' is on the meta device"):
        place_model(model)


def test_a_cpu_model_under_a_group_that_serves_only_cuda_names_the_parameter(cuda_only_group):
    # what init_process_group("nccl") on a machine without a GPU would meet: before, rank
    # agreement failed inside torch with "No backend type associated with device type cpu"
    with pytest.raises(ValueError) as info:
        zero_full.initialize(Net(), CONFIG)
    message = str(info.value)
    assert message.startswith("parameter 'a.weight' is on cpu, but the process group serves only cuda")
    assert "this process has no such accelerator" in message
