"""Handles: finish exactly once, idempotent wait, completion, timeouts, profiler ranges."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from comm_cases import over_worlds, result_of

from zero_comm import AllGatherHandle, TensorHandle, all_gather_coalesced, reduce_scatter_coalesced


class _FakeWork:
    """Stands in for a torch Work: completes when told to; counts waits."""

    def __init__(self, finishes_in_time: bool = True) -> None:
        self.done = False
        self.waits = 0
        self.finishes_in_time = finishes_in_time

    def wait(self, timeout=None):
        self.waits += 1
        if timeout is not None and not self.finishes_in_time:
            return False
        self.done = True
        return True

    def is_completed(self):
        return self.done


def test_finish_runs_once_and_wait_is_idempotent():
    work, calls = _FakeWork(), []
    handle = AllGatherHandle("all_gather", work, lambda: calls.append(1) or [torch.ones(2)])
    assert not handle.is_completed() and "pending" in repr(handle)
    first = handle.wait()
    assert handle.wait() is first and handle.wait(timedelta(seconds=1)) is first
    assert calls == [1] and work.waits == 1 and handle.is_completed()
    assert "finished" in repr(handle)


def test_a_timed_out_wait_leaves_the_handle_pending():
    work, calls = _FakeWork(finishes_in_time=False), []
    handle = TensorHandle("all_reduce", work, lambda: calls.append(1) or torch.zeros(1))
    with pytest.raises(TimeoutError, match="all_reduce did not complete within 0:00:00.010000"):
        handle.wait(timedelta(milliseconds=10))
    assert calls == [] and not handle.is_completed()
    work.finishes_in_time = True
    assert handle.wait().tolist() == [0.0] and calls == [1]


def test_a_synchronous_handle_is_complete_before_wait():
    handle = TensorHandle("broadcast", None, lambda: torch.ones(1))
    assert handle.is_completed() and "ready" in repr(handle)


def _profiled(rank):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        shards = [torch.ones(7), torch.ones(3)]
        handle = all_gather_coalesced(shards, async_op=True)
        handle.wait()
        reduce_scatter_coalesced([torch.ones(9)])
    names = {e.name for e in prof.events()}
    return sorted(n for n in names if n.startswith("zero."))


@over_worlds
def test_issue_and_finish_phases_are_profiler_ranges(dist, spec):
    world, rpn = spec
    expected = [
        "zero.all_gather.finish",
        "zero.all_gather.issue",
        "zero.reduce_scatter.finish",
        "zero.reduce_scatter.issue",
    ]
    if world > 1:
        expected.append("zero.reduce_scatter.local_sum")
    assert dist.run(world, _profiled, ranks_per_node=rpn) == [expected] * world


def _convention(rank):
    """Every public call: the result without async_op (as torch.distributed), a handle with it."""
    import torch.distributed as tdist

    import zero_comm

    world, me = rank.world_size, rank.rank
    results = []
    for async_op in (False, True):
        t = torch.full((world * 3,), float(me + 1))
        got = result_of(zero_comm.all_reduce(t, op="sum", async_op=async_op), async_op)
        assert got is t and t.tolist() == [world * (world + 1) / 2] * (world * 3)
        b = torch.full((4,), float(me))
        assert result_of(zero_comm.broadcast(b, src=world - 1, async_op=async_op), async_op) is b
        assert b.tolist() == [float(world - 1)] * 4
        out, inp = torch.empty(world * 2), me * 10 + torch.arange(world * 2.0)
        assert result_of(zero_comm.all_to_all_single(out, inp, async_op=async_op), async_op) is out
        ref = torch.empty(world * 2)
        tdist.all_to_all_single(ref, me * 10 + torch.arange(world * 2.0))
        assert torch.equal(out, ref)
        shards = [torch.full((2,), float(me)), torch.full((1,), -float(me))]
        full = result_of(zero_comm.all_gather_coalesced(shards, async_op=async_op), async_op)
        dests = [torch.empty(2 * world), torch.empty(world)]
        into = result_of(zero_comm.all_gather_coalesced_into(shards, dests, async_op=async_op), async_op)
        assert into == dests and all(torch.equal(a, b) for a, b in zip(full, dests))
        parts = result_of(
            zero_comm.reduce_scatter_coalesced([torch.ones(3)], op="sum", async_op=async_op), async_op
        )
        results.append((full[0].tolist(), parts[0].tolist()))
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_calls_return_their_result_unless_async(dist, world):
    got = dist.run(world, _convention)
    for r, (gathered, part) in enumerate(got):
        assert gathered == [float(q) for q in range(world) for _ in range(2)]
        assert part == [float(world)] * len(range(3)[r * -(-3 // world) :][: -(-3 // world)])
