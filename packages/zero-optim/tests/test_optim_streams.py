"""Side streams in ZeRO steps, on a recording stream double: the order of record / wait calls.

A stage-3 forward + backward with prefetch, then an optimizer step, through a
``CommStreams`` over ``zero_testing.RecordingStreamSource``; the gather and reduce-scatter
strategies log each collective and the stream it was issued on, the model logs each use.
Every gather runs on the gather stream after it waited on compute; the compute stream waits
on the gather's event right before the gathered values are taken, and before the module
uses them; every reduce-scatter runs on the reduce stream after it waited on a grad-ready
event of compute; the step comes after compute waited on the last reduce event. The numbers
equal those without streams bit for bit, and a plain torch run on the whole batch. Stages 0, 1
and 2 (``replicated_optimizer``) reduce on the reduce stream the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_params
from zero_comm import NO_STREAMS, AllToAllReduceScatter, CastAllReduce, CommStreams, FlatAllGather
from zero_coord import Coordinator, CoordinatorConfig
from zero_optim import ReduceConfig, replicated_optimizer, stage3_optimizer
from zero_testing import RecordingStreamSource


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


class _LoggedHandle:
    def __init__(self, handle, log, pid, dests):
        self.handle, self.log, self.pid, self.dests = handle, log, pid, dests

    def wait(self):
        out = self.handle.wait()
        self.log.append(("gathered", self.pid, frozenset(d.data_ptr() for d in self.dests)))
        return out

    def is_completed(self):
        return self.handle.is_completed()


class _LoggedPlan:
    def __init__(self, plan, log, source, pid, dests):
        self.plan, self.log, self.source, self.pid, self.dests = plan, log, source, pid, dests

    def issue(self, *, async_op=False):
        self.log.append(("all_gather", self.pid, self.source.current.name))
        return _LoggedHandle(self.plan.issue(async_op=async_op), self.log, self.pid, self.dests)


class _LoggedGather(FlatAllGather):
    """A flat gather whose planned gathers log their stream and the storages they fill."""

    __slots__ = ("log", "plans", "source")

    def __init__(self, log, source):
        super().__init__()
        self.log, self.source, self.plans = log, source, 0

    def plan_gather_into(self, shards, outputs):
        self.plans += 1
        plan = super().plan_gather_into(shards, outputs)
        return _LoggedPlan(plan, self.log, self.source, self.plans, outputs)


class _LoggedReduce(AllToAllReduceScatter):
    __slots__ = ("log", "source")

    def __init__(self, log, source):
        super().__init__()
        self.log, self.source = log, source

    def reduce_scatter_coalesced(self, tensors, *, op="avg", async_op=False):
        self.log.append(("reduce_scatter", self.source.current.name))
        return super().reduce_scatter_coalesced(tensors, op=op, async_op=async_op)


class _LoggedAllReduce(CastAllReduce):
    """Stage 0's all-reduce (through fp32: the gradients' own dtype), logging its stream."""

    __slots__ = ("log", "source")

    def __init__(self, log, source):
        super().__init__(torch.float32)
        self.log, self.source = log, source

    def all_reduce(self, tensor, op="avg"):
        self.log.append(("reduce_scatter", self.source.current.name))
        return super().all_reduce(tensor, op)


def _batch(step, world):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)


def _train(rank, recording, overlap, steps=2):
    world, r = rank.world_size, rank.rank
    source = RecordingStreamSource()
    log = source.log
    model = _model()
    zero_params.partition(
        model, gather_strategy=_LoggedGather(log, source), reduce_strategy=_LoggedReduce(log, source)
    )
    streams = CommStreams(source) if recording else NO_STREAMS
    cfg = ReduceConfig(reduce_bucket_size=40, overlap_comm=overlap)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opt, sink = stage3_optimizer(model, sgd, cfg, streams=streams)
    coordinator = Coordinator(model, CoordinatorConfig(prefetch_bucket_size=60), sink, streams=streams)
    coordinator.install()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(
                lambda m, args, name=name: log.append(
                    ("use", name, frozenset(p.data_ptr() for p in m.parameters()))
                )
            )
    for step in range(steps):
        x, y = _batch(step, world)
        loss = nn.functional.mse_loss(model(x[4 * r : 4 * (r + 1)]), y[4 * r : 4 * (r + 1)])
        loss.backward()
        log.append(("step",))
        opt.step()
        opt.zero_grad()
    prefetched = coordinator.total_stats.prefetch_hits
    coordinator.remove()
    with zero_params.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    return values, log, prefetched


def _reference(world, steps=2):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(step, world)
        rows = [slice(4 * r, 4 * (r + 1)) for r in range(world)]
        loss = sum(nn.functional.mse_loss(model(x[s]), y[s]) for s in rows)
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_order(log):
    """Assert the stream order of one rank's log; return (gathers, reduce-scatters) counted."""
    event_of = {}  # gather plan id -> its latest event
    last_pid = None
    gathered_ptrs = set()
    reduces = gathers = 0
    grad_ready = set()
    last_reduce = None
    for i, entry in enumerate(log):
        kind = entry[0]
        if kind == "all_gather":
            _, pid, stream = entry
            assert stream == "gather", entry
            # issued inside the gather stream, which waited on compute first
            assert log[i - 1] == ("enter", "gather") and log[i - 2] == ("wait_stream", "gather", "compute")
            assert log[i + 1] == ("enter", "compute")
            last_pid = pid
            gathers += 1
        elif kind == "record" and entry[1] == "gather":
            assert log[i - 2][0] == "all_gather"
            event_of[last_pid] = entry[2]
        elif kind == "gathered":
            _, pid, ptrs = entry
            # compute waited on this gather's event right before its values were taken
            assert log[i - 1] == ("wait_event", "compute", event_of.pop(pid)), (log[i - 1], pid)
            gathered_ptrs |= ptrs
        elif kind == "use":
            assert entry[2] <= gathered_ptrs, f"{entry[1]} used storage no waited gather filled"
        elif kind == "record" and entry[1] == "compute":
            grad_ready.add(entry[2])
        elif kind == "reduce_scatter":
            assert entry[1] == "reduce", entry
            j = i - 1
            while log[j][0] == "reduce_scatter":  # several in one bucket call
                j -= 1
            assert log[j] == ("enter", "reduce")
            assert log[j - 1][:2] == ("wait_event", "reduce") and log[j - 1][2] in grad_ready
            reduces += 1
        elif kind == "record" and entry[1] == "reduce":
            last_reduce = entry[2]
        elif kind == "step":
            # the step reads the partitions after compute waited on the last reduction
            waits = [e for e in log[:i] if e[:2] == ("wait_event", "compute")]
            assert waits and waits[-1][2] == last_reduce, (waits[-1:], last_reduce)
    assert not event_of, f"gathers never waited by compute: {event_of}"
    return gathers, reduces


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_stage3_step_orders_gathers_and_reductions_on_side_streams(dist, world, overlap):
    recorded = dist.run(world, _train, True, overlap)
    plain = dist.run(world, _train, False, overlap)
    reference = _reference(world)
    for (values, log, prefetched), (plain_values, plain_log, _) in zip(recorded, plain, strict=True):
        gathers, reduces = _check_order(log)
        assert gathers > 0 and reduces > 0 and prefetched > 0
        assert not [e for e in plain_log if e[0] in ("enter", "record", "wait_event", "wait_stream")]
        # the same gathers, in the same order, on the compute stream without streams
        gathers_plain = [e[:2] for e in plain_log if e[0] == "all_gather"]
        assert gathers_plain == [e[:2] for e in log if e[0] == "all_gather"]
        assert {e[-1] for e in plain_log if e[0] in ("all_gather", "reduce_scatter")} == {"compute"}
        for name, value in values.items():
            assert torch.equal(value, plain_values[name]), name
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)


def _train_replicated(rank, stage, recording, steps=2):
    world, r = rank.world_size, rank.rank
    source = RecordingStreamSource()
    log = source.log
    model = _model()
    streams = CommStreams(source) if recording else NO_STREAMS
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opt, reduction = replicated_optimizer(
        model,
        sgd,
        stage,
        ReduceConfig(reduce_bucket_size=40),
        reduce_strategy=_LoggedReduce(log, source) if stage else None,
        all_reduce_strategy=None if stage else _LoggedAllReduce(log, source),
        streams=streams,
    )
    for step in range(steps):
        x, y = _batch(step, world)
        reduction.begin_micro_step(True)
        nn.functional.mse_loss(model(x[4 * r : 4 * (r + 1)]), y[4 * r : 4 * (r + 1)]).backward()
        reduction.at_boundary()
        log.append(("step",))
        opt.step()
        opt.zero_grad()
    reduction.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, log


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_stage012_reductions_run_on_the_reduce_stream(dist, world, stage):
    recorded = dist.run(world, _train_replicated, stage, True)
    plain = dist.run(world, _train_replicated, stage, False)
    reference = _reference(world)
    for (values, log), (plain_values, plain_log) in zip(recorded, plain, strict=True):
        gathers, reduces = _check_order(log)
        assert gathers == 0 and reduces >= 2 * 2, (stage, reduces)  # several buckets per step
        assert not [e for e in plain_log if e[0] in ("enter", "record", "wait_event", "wait_stream")]
        assert [e[0] for e in plain_log if e[0] == "reduce_scatter"] == ["reduce_scatter"] * reduces
        for name, value in values.items():
            assert torch.equal(value, plain_values[name]), name
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)
