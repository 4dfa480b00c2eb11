"""WaitTimings: issue, wait start and wait end of every collective waited through the watchdog.

The collectives are fake work objects that complete at a set time (``wait`` sleeps until then),
so leads and waits are known: a collective issued, left alone for 60 ms and completing 100 ms
after its issue has a lead of at least 60 ms and a wait of about 40 ms.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import zero_comm
from zero_comm import CommLedger, CommWatchdog, Topology, WaitRecord, WaitTimings
from zero_comm.watched import watched_call


class _DoneAt:
    """A work object that completes ``after`` seconds after it was made (``wait`` blocks until then)."""

    def __init__(self, after: float) -> None:
        self.at = time.perf_counter() + after

    def wait(self, timeout=None):
        time.sleep(max(0.0, self.at - time.perf_counter()))
        return True

    def is_completed(self):
        return time.perf_counter() >= self.at


def _collective(after: float, made: list[_DoneAt] | None = None):
    def issue(*args, async_op=False, **kwargs):
        work = _DoneAt(after)
        if made is not None:
            made.append(work)
        return work

    return issue


@pytest.fixture
def watchdog():
    wd = CommWatchdog(dist.HashStore(), 0, 1, timeout=30, heartbeat_interval=1.0)
    try:
        with CommLedger(Topology.__new__(Topology), watchdog=wd):
            yield wd
    finally:
        wd.close()


def test_nothing_is_recorded_without_a_recorder(watchdog):
    assert watchdog.timings is None
    work = watched_call("all_gather", _collective(0.0), async_op=True)
    watchdog.wait(work)  # no recorder: nothing to record into, nothing fails


def test_lead_and_wait_of_an_asynchronous_collective(watchdog):
    timings = watchdog.timings = WaitTimings()
    zero_comm.note_collectives(lambda: "gathers `mid`")  # rendered when recorded
    work = watched_call("all_gather", _collective(0.1), async_op=True)
    time.sleep(0.06)
    watchdog.wait(work)
    (record,) = timings.records
    assert isinstance(record, WaitRecord)
    assert (record.op, record.call, record.what) == ("all_gather", 1, "gathers `mid`")
    assert record.issued <= record.waited <= record.done
    assert record.lead_s >= 0.06  # left alone that long after the issue
    assert record.done >= work.at  # the wait returned once the work completed ...
    assert record.wait_s >= work.at - record.waited  # ... and lasted at least until then
    assert record.lead_s + record.wait_s == pytest.approx(record.done - record.issued)


def test_a_synchronous_collective_waits_at_once_and_each_wait_is_recorded_once(watchdog):
    timings = watchdog.timings = WaitTimings()
    zero_comm.note_collectives("reduce-scatters the gradients of `out`")
    made: list[_DoneAt] = []
    assert watched_call("reduce_scatter", _collective(0.2, made), async_op=False) is None
    work = watched_call("all_reduce", _collective(0.0), async_op=True)
    watchdog.wait(work)
    watchdog.wait(work)  # waited again: not a second record
    first, second = timings.records
    assert (first.op, first.call, second.op, second.call) == ("reduce_scatter", 1, "all_reduce", 2)
    # synchronous: the wait starts right after the issue, before the work completes, and lasts until it does
    assert first.issued <= first.waited <= made[0].at <= first.done
    assert len(timings.records) == 2


def test_clear_forgets_records_and_collectives_not_yet_waited_for(watchdog):
    timings = watchdog.timings = WaitTimings()
    watchdog.wait(watched_call("all_gather", _collective(0.0), async_op=True))
    pending = watched_call("all_gather", _collective(0.0), async_op=True)
    assert "records=1, pending=1" in repr(timings)
    timings.clear()
    watchdog.wait(pending)  # issued before clear(): its issue time is gone, so it is not recorded
    assert timings.records == [] and "pending=0" in repr(timings)


def test_a_work_waited_outside_the_watchdog_is_never_recorded(watchdog):
    timings = watchdog.timings = WaitTimings()
    work = watched_call("all_gather", _collective(0.0), async_op=True)
    work.wait()
    other = _DoneAt(0.0)
    timings.waited(other, time.perf_counter())  # never issued through the watchdog
    assert timings.records == []
