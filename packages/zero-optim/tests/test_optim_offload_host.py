"""Optimizer offload with the fp32 master and gradient partition in host memory (a split placement).

On an accelerator the device keeps only the working parameters; here, where the CPU is its
own host, a placement that says ``split`` runs the same data flow: the masters and gradient
partitions are allocated by the placement's host memory, the working copy is a buffer of
its own (in fp32 too), the offloaded optimizer steps the host buffers in place, every
updated range goes to the working copy through the side stream (``non_blocking``), and the
compute stream waits for those copies before the partitioning publishes the parameters.
Numbers: the same as without offload, bit for bit, at world 1 and 2, stages 1, 2 and 3.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from optim_cases import Odd, batch, make_optimizer, micro_step
from test_optim_core import OddModel, WholeParams

import zero_params
from zero_offload import AdamKernel, HostMemory, HostPlacement, Inline, OptimizerOffloadConfig
from zero_optim import PartitionedOptimizer, ReduceConfig, replicated_optimizer, stage3_optimizer
from zero_testing import CopyLog
from zero_testing.offload import RecordingMemory, recording_side_stream

CFG = OptimizerOffloadConfig(sub_group_size=100, kernel=AdamKernel.EXACT)


def _make(params):
    return torch.optim.AdamW(
        [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.2}], lr=1e-2, foreach=False
    )


class LoggedParams(WholeParams):
    """:class:`WholeParams` that logs when the parameters are published."""

    def __init__(self, log):
        self.log = log

    def after_step(self, groups):
        self.log.append(("after_step",))


def _step(model, opt, seed):
    x = torch.randn(5, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad() if isinstance(opt, PartitionedOptimizer) else opt.zero_grad(set_to_none=False)
    model(x).backward()
    opt.step()


def test_the_host_master_is_stepped_in_place_and_published_through_the_side_stream():
    working_dtype = torch.float32
    log = []
    memory = RecordingMemory()
    placement = HostPlacement(torch.device("cpu"), memory, recording_side_stream(log), split=True)
    ref = OddModel().to(working_dtype)
    model = copy.deepcopy(ref)
    plain = PartitionedOptimizer(ref, _make, WholeParams(), working_dtype=working_dtype)
    opt = PartitionedOptimizer(
        model, _make, LoggedParams(log), working_dtype=working_dtype, offload=CFG, placement=placement
    )
    assert opt.placement is placement
    allocated = {t.data_ptr() for t in memory.allocated}
    for group in opt.groups:  # master and gradient partition: host buffers; the working copy apart
        assert group.master.data_ptr() in allocated and group.grad.data_ptr() in allocated
        assert group.working is not group.master and group.working.data_ptr() not in allocated
        assert group.working.dtype == working_dtype
    masters = {g.master.data_ptr() for g in opt.groups}
    assert not masters & {t.data_ptr() for t in opt.offload.state_tensors()}  # no second host master
    numel = sum(g.numel for g in opt.groups)
    assert opt.offloaded_device_bytes == numel * 4 * 4  # master, gradient, exp_avg, exp_avg_sq
    for s in range(3):
        _step(ref, plain, s)
        log.clear()
        with CopyLog(log):
            _step(model, opt, s)
        copies = [e for e in log if e[0] == "copy" and e[2]]
        assert sum(n for _, n, _ in copies) == numel  # each element sent to the device once
        assert [e for e in log if e[0] == "copy" and not e[2] and e[1] > 1] == []  # no blocking copy
        last_copy = max(i for i, e in enumerate(log) if e == copies[-1])
        join = next(i for i, e in enumerate(log) if e[0] == "wait_event")
        assert last_copy < join < log.index(("after_step",))  # joined before the parameters are read
        if s:  # the host waited for the last step's copies before stepping the masters again
            first_copy = log.index(copies[0])
            assert next(i for i, e in enumerate(log) if e[0] == "synchronize") < first_copy
    assert opt.offload.transfers.grad_down.count == opt.offload.transfers.param_up.count == 0
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_cpu_engine_offloads_as_before():
    """Device == host: masters stay where the device is, fp32 working is the master, counted copies."""
    model = OddModel()
    opt = PartitionedOptimizer(model, _make, WholeParams(), offload=CFG)
    assert not opt.placement.split and isinstance(opt.placement.copies, Inline)
    assert all(g.working is g.master for g in opt.groups)
    _step(model, opt, 0)
    numel = sum(g.numel for g in opt.groups)
    assert opt.offload.transfers.grad_down.nbytes == opt.offload.transfers.param_up.nbytes == numel * 4
    assert opt.offloaded_device_bytes == numel * 4 * 2  # the moments only


def test_partial_offload_keeps_its_master_on_the_device():
    split = HostPlacement(torch.device("cpu"), HostMemory(), Inline(), split=True)
    cfg = dataclasses.replace(CFG, ratio=0.5, sub_group_size=7)
    opt = PartitionedOptimizer(OddModel(), _make, WholeParams(), offload=cfg, placement=split)
    assert not opt.placement.split and all(g.working is g.master for g in opt.groups)


def _train(rank, stage, split, offload, kind, dtype=torch.float32, steps=3):
    model = Odd(unused=stage != 3).to(dtype)
    placement = HostPlacement(torch.device("cpu"), RecordingMemory(), Inline(), split=True) if split else None
    cfg = CFG if offload else None
    red = ReduceConfig(reduce_bucket_size=300)
    if stage == 3:
        zero_params.partition(model)
        opt, sink = stage3_optimizer(
            model, make_optimizer(kind), red, working_dtype=dtype, offload=cfg, placement=placement
        )
    else:
        opt, sink = replicated_optimizer(
            model, make_optimizer(kind), stage, red, working_dtype=dtype, offload=cfg, placement=placement
        )
    if split:
        allocated = {t.data_ptr() for t in placement.memory.allocated}
        assert all(g.master.data_ptr() in allocated and g.grad.data_ptr() in allocated for g in opt.groups)
        assert all(g.working.dtype == dtype and g.working.data_ptr() not in allocated for g in opt.groups)
    world, r = rank.world_size, rank.rank
    for step in range(steps):
        x = batch(step, 0, world)[4 * r : 4 * (r + 1)].to(dtype)
        if stage == 3:
            micro_step(model, sink, x)
        else:
            model(x).backward()
            sink.at_boundary()
        opt.step()
        opt.zero_grad()
    if stage != 3:
        sink.remove()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    with zero_params.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_masters_train_exactly_like_device_masters(dist, world, stage):
    """Split placement against offload without it (AdamW, the same CPU Adam) and against no offload
    (SGD: the host twin is torch's SGD): bit-identical parameters on every rank."""
    for kind, offload in (("adamw", True), ("sgd", False)):
        split = dist.run(world, _train, stage, True, True, kind)
        ref = dist.run(world, _train, stage, False, offload, kind)
        for a, b in zip(split, ref):
            assert a.keys() == b.keys()
            for n in a:
                assert torch.equal(a[n], b[n]), (kind, n)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_working_parameters_follow_host_masters_exactly(dist, stage):
    """bf16 working copies on the device, fp32 masters on the host: as with device masters."""
    split = dist.run(2, _train, stage, True, True, "adamw", torch.bfloat16)
    ref = dist.run(2, _train, stage, False, True, "adamw", torch.bfloat16)
    for a, b in zip(split, ref):
        for n in a:
            assert a[n].dtype == torch.bfloat16 and torch.equal(a[n], b[n]), n
