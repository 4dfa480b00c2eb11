"""Handles: finish exactly once, idempotent wait, completion, timeouts, profiler ranges."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from comm_cases import over_worlds

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
