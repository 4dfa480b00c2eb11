"""``profile_range`` records a named range under a profiler and costs nothing without one."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from zero_comm.profiling import profile_range


def test_a_range_is_recorded_under_a_profiler_and_is_a_shared_no_op_without():
    idle = profile_range("zero.test.idle")
    assert idle is profile_range("zero.test.other")  # one shared no-op context, no dispatch
    with idle:
        torch.ones(3).sum()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with profile_range("zero.test.recorded"):
            torch.ones(3).sum()
    names = [e.name for e in prof.events()]
    assert "zero.test.recorded" in names
    assert "zero.test.idle" not in names
