"""control_device: control-plane tensors go where the process group has a backend.

Groups of one rank, each made with a backend string that lists the device types it serves
(``cuda:gloo`` serves only ``cuda``, as ``nccl`` does); no tensor is sent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zero_comm import control_device, served_device_types


@pytest.fixture
def world_of_one():
    dist.init_process_group("cpu:gloo,cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_without_a_process_group_control_tensors_stay_on_the_cpu():
    assert served_device_types() == ("cpu",)
    assert control_device() == torch.device("cpu")


@pytest.mark.parametrize(
    ("backend", "served", "device"),
    [
        ("gloo", {"cpu", "cuda"}, "cpu"),
        ("cpu:gloo,cuda:gloo", {"cpu", "cuda"}, "cpu"),  # a CPU backend beside the accelerator's: cheap
        ("cuda:gloo", {"cuda"}, "cuda"),  # what nccl serves: no CPU tensor may enter it
    ],
)
def test_a_group_that_serves_no_cpu_gets_its_own_device(world_of_one, backend, served, device):
    group = dist.new_group([0], backend=backend)
    assert set(served_device_types(group)) == served
    assert control_device(group).type == device
    assert control_device().type == "cpu"  # the default group still serves the CPU
