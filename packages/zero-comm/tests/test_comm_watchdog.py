"""CommWatchdog: positions, heartbeats through a store, and the diagnosis of a stuck wait.

The store is a ``torch.distributed.HashStore`` shared by "ranks" that are watchdog objects in
this process; the collective is a fake work object that never completes, or one with NCCL's
timed-wait semantics, so every path is exercised without a process group.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from comm_cases import Done, NeverDone, failed_wait, watchdog_pair

import zero_comm
from zero_comm import CollectiveTimeoutError, CommLedger, CommWatchdog, Topology
from zero_comm.watched import active_watchdog, collective_label, watched_call


class _Communicator:
    aborted = False


class _NcclWork:
    """Completes ``after`` seconds after it was issued; its timed wait behaves as NCCL's.

    ``wait(timeout)`` counts ``timeout`` from the collective's start and, when it expires before
    the work completes, aborts the communicator and raises (what ``ProcessGroupNCCL`` does).
    """

    def __init__(self, comm: _Communicator, after: float) -> None:
        self.comm = comm
        self.issued = time.monotonic()
        self.done_at = self.issued + after

    def is_completed(self):
        if self.comm.aborted:
            raise RuntimeError("NCCL communicator was aborted")
        return time.monotonic() >= self.done_at

    def wait(self, timeout=None):
        if self.comm.aborted:
            raise RuntimeError("NCCL communicator was aborted")
        if timeout is not None and self.issued + timeout.total_seconds() < self.done_at:
            time.sleep(max(0.0, self.issued + timeout.total_seconds() - time.monotonic()))
            self.comm.aborted = True
            raise RuntimeError("Watchdog caught collective operation timeout: aborting the NCCL communicator")
        time.sleep(max(0.0, self.done_at - time.monotonic()))
        return True


def test_label_names_modules_in_order():
    assert collective_label("gathers", ["mid.weight", "mid.bias", "out.weight"]) == "gathers `mid`, `out`"
    assert collective_label("gathers", ["a.w", "b.w", "c.w", "d.w"], limit=2) == "gathers `a`, `b` and 2 more"
    assert collective_label("gathers", ["bias"]) == "gathers `bias`"


def test_positions_are_recorded_and_published():
    with watchdog_pair() as (me, peer):
        peer.note(lambda: "gathers `mid`")  # rendered only when published
        peer.issued("all_gather")
        peer.issued("all_gather")
        peer.publish()
        seen = me.peers()[1]
        assert seen is not None and seen.call == 2 and seen.op == "all_gather"
        assert seen.describe() == "rank 1 gathers `mid` (call 2)"


def test_a_different_position_after_the_timeout_is_a_diverged_path():
    with watchdog_pair(timeout=0.5) as (me, peer):
        me.note("gathers `out`")
        me.issued("all_gather")
        peer.note("reduces the gradients of `mid`")
        peer.issued("reduce_scatter")
        peer.issued("reduce_scatter")
        message, waited = failed_wait(me, CollectiveTimeoutError)
        assert waited < 3
        assert "rank 0 gathers `out` (call 1) while rank 1 reduces the gradients of `mid` (call 2)" in message
        assert "ranks took different paths" in message and "comm_timeout = 0.5" in message


def test_a_silent_peer_is_named_before_the_timeout():
    with watchdog_pair(timeout=60, interval=0.05, beat_peer=False) as (me, peer):
        _, waited = failed_wait(
            me, CollectiveTimeoutError, match=r"rank 1 sent no heartbeat for \d+ s: it died or is stuck"
        )
        assert waited < 5  # 5 heartbeat intervals, not the 60 s timeout


def test_a_connection_error_names_the_dead_rank_not_the_socket():
    with watchdog_pair(timeout=60, interval=0.05, beat_peer=False) as (me, peer):
        message, _ = failed_wait(
            me, CollectiveTimeoutError, NeverDone("Connection reset by peer [127.0.0.1]:56473")
        )
        assert message.startswith("rank 1 sent no heartbeat")
        assert "Connection reset by peer" in message  # the original, after the diagnosis


def test_collectives_run_under_the_watchdog_of_the_active_ledger():
    with watchdog_pair() as (me, peer):
        calls = []

        def fake_collective(*args, async_op=False, **kwargs):
            calls.append(async_op)
            return Done()

        assert active_watchdog() is None
        assert isinstance(watched_call("all_reduce", fake_collective, 1, async_op=False), Done)
        with CommLedger(Topology.__new__(Topology), watchdog=me):
            assert active_watchdog() is me
            with CommLedger(Topology.__new__(Topology)):  # an inner ledger without one inherits it
                assert active_watchdog() is me
                zero_comm.note_collectives("all-reduces the gradient norm")
                assert watched_call("all_reduce", fake_collective, 1, async_op=False) is None
                assert isinstance(watched_call("all_reduce", fake_collective, 1, async_op=True), Done)
        assert calls == [False, True, True]  # under the watchdog every collective is issued async
        assert me.position().call == 2 and me.position().what == "all-reduces the gradient norm"


def test_the_heartbeat_thread_stops_with_close_and_with_the_watchdog():
    with watchdog_pair() as (me, peer):
        before = {t.name for t in threading.enumerate()}
        assert "zero-watchdog-rank0" in before
        me.close()
        peer.close()
        assert not {"zero-watchdog-rank0", "zero-watchdog-rank1"} & {t.name for t in threading.enumerate()}


# A watchdog nobody closed. The hook is registered before torch is imported (before any
# weakref.finalize exists), so it runs after every other exit hook, the finalizers' included.
_NEVER_CLOSED = """
import atexit
seen = []
atexit.register(lambda: print("heartbeat alive at exit:", any(t.is_alive() for t in seen)))
import threading, time
import torch.distributed as dist
from zero_comm import CommWatchdog
wd = CommWatchdog(dist.TCPStore("127.0.0.1", 0, 1, True), 0, 2, heartbeat_interval=1e-6)
seen.append(next(t for t in threading.enumerate() if t.name == "zero-watchdog-rank0"))
time.sleep(0.2)
"""


def test_a_watchdog_never_closed_stops_its_heartbeat_before_the_interpreter_finalizes():
    # A daemon thread still in a store call at finalization aborts the process in C++
    # ("terminate called without an active exception"): the heartbeat is stopped at exit first.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _NEVER_CLOSED], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert "heartbeat alive at exit: False" in proc.stdout, proc.stdout


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="must be > 0"):
        CommWatchdog(dist.HashStore(), 0, 2, timeout=0)


# --------------------------------------------------------------------------- departures from the module order


def _depart(wd, what, found):
    try:
        wd.diverged(what)
        found[wd.rank] = None
    except CollectiveTimeoutError as exc:
        found[wd.rank] = exc


def test_ranks_that_depart_alike_go_on():
    with watchdog_pair(timeout=5) as (me, peer):
        for wd in (me, peer):
            wd.issued("all_gather")
        found = {}
        threads = [
            threading.Thread(target=_depart, args=(wd, "runs `mid` (forward)", found)) for wd in (me, peer)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert found == {0: None, 1: None}


def test_watchdogs_alive_at_once_on_one_store_keep_their_records_apart():
    """Two engines' watchdogs in each rank: the older one's heartbeat (further along, more
    collectives) never stands in for the newer one's record, so the newer ones agree on a departure."""
    store = dist.HashStore()
    old = [
        CommWatchdog(store, r, 2, timeout=5, heartbeat_interval=0.01, namespace="engine1/") for r in (0, 1)
    ]
    new = [
        CommWatchdog(store, r, 2, timeout=5, heartbeat_interval=0.01, namespace="engine2/") for r in (0, 1)
    ]
    try:
        for wd in old:
            for _ in range(40):
                wd.issued("all_gather")
        for wd in new:
            wd.issued("all_gather")
            wd.publish()
        old[1].publish()  # the last write of rank 1: its older watchdog's record
        seen = new[0].peers()[1]
        assert seen is not None and seen.call == 1, seen
        found = {}
        threads = [threading.Thread(target=_depart, args=(wd, "engine.save_checkpoint", found)) for wd in new]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert found == {0: None, 1: None}
    finally:
        for wd in (*old, *new):
            wd.close()


def test_a_rank_that_departs_alone_raises_and_so_does_the_peer_waiting_for_it():
    with watchdog_pair(timeout=30, interval=0.05) as (me, peer):
        me.note("gathers `out`")
        me.issued("all_gather")
        me.issued("all_gather")  # rank 0 went on along the recorded order
        me.publish()
        peer.issued("all_gather")
        start = time.monotonic()
        with pytest.raises(zero_comm.RanksDivergedError) as info:
            peer.diverged("runs `mid` (forward) where its recorded order has 'out' (forward)")
        assert str(info.value).startswith(
            "rank 0 gathers `out` (call 2) while rank 1 runs `mid` (forward) where its recorded order "
            "has 'out' (forward) (before call 2): ranks took different paths"
        ), str(info.value)
        with pytest.raises(zero_comm.RanksDivergedError) as waiting:  # rank 0, blocked in its gather
            me.wait(NeverDone())
        assert str(waiting.value) == str(info.value)
        # the departed rank may exit: its closed connection is still reported as the divergence
        with pytest.raises(zero_comm.RanksDivergedError):
            me.wait(NeverDone("Connection closed by peer [127.0.0.1]:53121"))
        assert time.monotonic() - start < 5


def test_a_peer_that_never_published_is_not_dead_before_the_timeout():
    store = dist.HashStore()
    me = CommWatchdog(store, 0, 2, timeout=1.0, heartbeat_interval=0.05)  # rank 1 never starts
    try:
        _, waited = failed_wait(me, CollectiveTimeoutError, match=r"never reached zero")
        assert waited >= 1.0  # not after 5 heartbeats (0.25 s): it may be slow to start
    finally:
        me.close()


class _CountingStore:
    """A HashStore that counts writes and reads."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.sets = 0
        self.reads = 0

    def set(self, key, value):
        self.sets += 1
        self.inner.set(key, value)

    def check(self, keys):
        self.reads += 1
        return self.inner.check(keys)

    def get(self, key):
        return self.inner.get(key)


def test_the_heartbeat_thread_writes_once_per_interval_and_reads_nothing():
    store = _CountingStore()
    wd = CommWatchdog(store, 0, 2, timeout=60, heartbeat_interval=0.1)
    try:
        time.sleep(1.0)
        writes, reads = store.sets, store.reads
    finally:
        wd.close()
    assert 2 <= writes <= 1 + 11, writes  # the first publish, then at most 10 beats (loaded: fewer)
    assert reads == 0  # the store is read only while a wait is slow or a rank departs from its path


class _SlowReadStore(_CountingStore):
    """Reads from the main thread take 3 ms: a heartbeat due meanwhile queues on the store lock."""

    def get(self, key):
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.003)
        return super().get(key)


def test_a_departed_ranks_last_record_is_not_overwritten_by_a_stale_heartbeat():
    # Rank 1 publishes `broken` and exits while a heartbeat built before it lands after it: rank 0
    # must still see the departure, not report rank 1 as silent. Without the guard 44-47 of 50
    # rounds lost the record here (3 runs).
    lost = 0
    for _ in range(50):
        store = _SlowReadStore()
        ahead = CommWatchdog(store, 0, 2, timeout=30, heartbeat_interval=60)
        departs = CommWatchdog(store, 1, 2, timeout=30, heartbeat_interval=0.001)
        try:
            ahead.issued("all_gather")
            ahead.issued("all_gather")
            ahead.publish()
            departs.issued("all_gather")
            with pytest.raises(zero_comm.RanksDivergedError):
                departs.diverged("runs `mid` (forward)")
        finally:
            departs.close()
            ahead.close()
        time.sleep(0.01)  # a heartbeat still in flight lands now
        (position,) = ahead.peers().values()
        lost += not position.broken
    assert lost == 0, f"{lost} of 50 departures lost their last record"


# --------------------------------------------------------------------------- NCCL's timed wait


def test_a_rank_three_seconds_late_does_not_abort_an_nccl_communicator():
    # the default heartbeat interval (2 s): a timed wait of one interval would abort at 2 s
    with watchdog_pair(timeout=60, interval=2.0) as (me, peer):
        comm = _Communicator()
        me.issued("all_gather")
        work = _NcclWork(comm, after=3.0)  # the peer joins the collective 3 s late
        me.wait(work)
        assert not comm.aborted
        assert work.is_completed() and not me.position().waiting


def test_a_late_rank_past_comm_timeout_is_named_and_the_communicator_lives():
    with watchdog_pair(timeout=1.0, interval=0.1) as (me, peer):
        comm = _Communicator()
        me.note("gathers `out`")
        me.issued("all_gather")
        peer.publish()  # late: it has not reached the gather yet
        message, waited = failed_wait(me, CollectiveTimeoutError, _NcclWork(comm, after=30.0))
        assert 1.0 <= waited < 10
        assert "rank 0 gathers `out` (call 1) while rank 1 is outside any collective (call 0)" in message
        assert "comm_timeout = 1" in message
        assert not comm.aborted  # zero raised; the communicator is left to the backend
