"""Host placement of offloaded optimizer buffers: pinned or plain memory, side-stream copies, split steps.

A CPU is its own host, so the split data flow (fp32 master and gradient on the host, the
working copy on the device) runs here with a placement that says ``split`` on a CPU and a
side stream built on recording doubles: what is asserted is which buffers are allocated
where, that the step works in place (no copies) and the order of the stream calls.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_offload import (
    AdamKernel,
    HostMemory,
    HostPlacement,
    Inline,
    OffloadedOptimizer,
    OptimizerOffloadConfig,
    SideStream,
    host_memory,
    host_placement,
    offload_optimizer_for,
)
from zero_testing import CopyLog
from zero_testing.offload import RecordingMemory, recording_side_stream


def test_host_memory_pins_only_where_an_accelerator_exists():
    assert host_memory(False) == HostMemory(pinned=False)
    assert host_memory(True).pinned == torch.accelerator.is_available()
    t = HostMemory().zeros(5, torch.bfloat16)
    assert t.device.type == "cpu" and t.dtype == torch.bfloat16 and not t.any()
    src = torch.arange(6.0).view(2, 3)
    assert torch.equal(HostMemory().copy_of(src), src)


def test_a_cpu_engine_keeps_its_buffers_in_place_and_copies_inline():
    placement = host_placement(torch.device("cpu"), pin_memory=True)
    assert not placement.split and placement.master_device == torch.device("cpu")
    assert isinstance(placement.copies, Inline)
    assert placement.memory.pinned == torch.accelerator.is_available()
    split = dataclasses.replace(placement, split=True)
    assert split.master_device == torch.device("cpu")


def test_side_stream_waits_for_compute_copies_non_blocking_and_joins_with_an_event():
    log = []
    stream = recording_side_stream(log)
    stream.join()  # nothing issued: nothing to wait for
    assert log == []
    a, b = torch.zeros(3), torch.zeros(4)
    with CopyLog(log):
        stream.copy(a, torch.ones(3))
        stream.copy(b, torch.ones(4))
    stream.join()
    event = log[-1][2]
    assert log == [
        ("wait_stream", "side", "compute"),  # the side stream starts after what compute issued
        ("enter", "side"),
        ("copy", 3, True),
        ("enter", "compute"),
        ("enter", "side"),
        ("copy", 4, True),
        ("enter", "compute"),
        ("record", "side", event),
        ("wait_event", "compute", event),  # compute reads nothing before the copies landed
    ]
    assert a.sum() == 3 and b.sum() == 4
    log.clear()
    stream.join()
    assert log == []  # joined once per batch of copies
    stream.settle()
    assert log == [("synchronize", event)]  # the host waits before it writes the sources again
    stream.settle()
    assert log == [("synchronize", event)]
    log.clear()
    stream.copy(a, torch.zeros(3))
    assert log[0] == ("wait_stream", "side", "compute")  # a new batch waits for compute again


def test_a_side_stream_of_something_else_than_a_stream_source_is_refused_by_name():
    with pytest.raises(TypeError, match=r"needs a zero_comm.StreamSource .* got device"):
        SideStream(torch.device("cpu"))


def _flat(seed, sizes=(1037, 13)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_split_placement_steps_the_host_master_and_gradient_in_place(kind):
    """The masters and gradients given are the host buffers: no copies, no second master, same numbers."""
    cfg = OptimizerOffloadConfig(sub_group_size=100, kernel=AdamKernel.EXACT)
    memory = RecordingMemory()
    split = HostPlacement(torch.device("cpu"), memory, Inline(), split=True)

    def build(placement):
        masters = [memory.copy_of(t) for t in _flat(0)]
        grads = [memory.zeros(m.numel()) for m in masters]
        params = [torch.nn.Parameter(m) for m in masters]
        make = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
        user = make([{"params": params[:1]}, {"params": params[1:], "lr": 0.02}], lr=0.01)
        off = offload_optimizer_for(user, masters, grads, cfg, placement=placement)
        return masters, grads, off

    plain_m, plain_g, plain = build(None)
    memory.allocated.clear()
    host_m, host_g, host = build(split)
    before = len(memory.allocated)
    assert not any(t.data_ptr() == m.data_ptr() for t in host.state_tensors() for m in host_m)
    ranges = []
    for step in range(3):
        for pg, hg, new in zip(plain_g, host_g, _flat(10 + step)):
            pg.copy_(new)
            hg.copy_(new)
        plain.step()
        host.step(after=lambda gi, a, b: ranges.append((gi, a, b)))
    for a, b in zip(plain_m, host_m):
        assert torch.equal(a, b)
    if isinstance(host, OffloadedOptimizer):
        assert host.transfers.grad_down.count == host.transfers.param_up.count == 0  # stepped where they live
        assert plain.transfers.grad_down.count > 0
        assert host.device_bytes_saved == sum(m.numel() for m in host_m) * 4 * 4
        assert plain.device_bytes_saved == sum(m.numel() for m in host_m) * 4 * 2
        stepped = {(sg.group, sg.offset, sg.offset + sg.numel) for sg in host.subgroups}
        assert ranges == sorted(stepped) * 3  # each sub-group handed on once it is updated
    else:
        assert host.device_bytes_saved == plain.device_bytes_saved + sum(m.numel() for m in host_m) * 8
        assert ranges == [(0, 0, 1037), (1, 0, 13)] * 3
    assert len(memory.allocated) == before  # no host buffer allocated per step


def test_partial_offload_refuses_a_host_master():
    m = [torch.zeros(10)]
    opt = torch.optim.AdamW([torch.nn.Parameter(m[0])])
    split = HostPlacement(torch.device("cpu"), HostMemory(), Inline(), split=True)
    with pytest.raises(ValueError, match="partial optimizer offload"):
        offload_optimizer_for(opt, m, [torch.zeros(10)], OptimizerOffloadConfig(ratio=0.5), placement=split)
