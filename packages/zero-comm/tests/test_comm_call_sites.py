"""Engine-call signatures, a rank that left the path, a closed peer and a stuck peer.

Signatures are checked as rows; the watchdog paths run on watchdog objects sharing a
``HashStore`` in this process, with a collective that never completes (the all-gather itself
runs in the fault suite, integration_tests/test_integration_faults.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from comm_cases import Done, NeverDone, failed_wait, watchdog_pair

from zero_comm import CommWatchdog, RanksDivergedError
from zero_comm.call_sites import FIELDS, calls_differ, describe_call, mismatch_text, signature
from zero_comm.watchdog import CollectiveTimeoutError


@pytest.mark.parametrize("site", ["engine.forward", "engine.consolidated_state_dict", "é" * 16, ""])
def test_a_signature_carries_the_call_exactly(site):
    row = signature(site, 7, 29, 1234)
    assert row.dtype == torch.int64 and row.numel() == FIELDS
    assert (
        describe_call(3, row) == f"rank 3 calls {site} at optimizer step 7, micro-step 29 (after call 1234)"
    )


def test_a_long_site_is_cut_to_32_bytes():
    row = signature("engine." + "x" * 40, 0, 0, 0)
    assert (
        describe_call(0, row)
        == "rank 0 calls engine." + "x" * 25 + " at optimizer step 0, micro-step 0 (after call 0)"
    )


def test_calls_differ_on_site_step_or_micro_step_not_on_the_collective_count():
    base = signature("engine.step", 3, 6, 40)
    assert not calls_differ(torch.stack([base, signature("engine.step", 3, 6, 41)]))
    for other in (signature("engine.save_checkpoint", 3, 6, 40), signature("engine.step", 4, 6, 40)):
        assert calls_differ(torch.stack([base, other]))
    assert calls_differ(torch.stack([base, base, signature("engine.step", 3, 7, 40)]))


def test_the_mismatch_names_every_ranks_call_site():
    rows = torch.stack(
        [signature("engine.consolidated_state_dict", 1, 1, 14), signature("engine.forward", 1, 1, 14)]
    )
    text = mismatch_text(rows, [0, 1])
    assert text.startswith(
        "rank 0 calls engine.consolidated_state_dict at optimizer step 1, micro-step 1 (after call 14) "
        "while rank 1 calls engine.forward at optimizer step 1, micro-step 1 (after call 14): "
        "ranks took different paths"
    )


def test_a_rank_that_abandons_is_named_by_the_peer_waiting_and_refuses_its_own_next_call():
    with watchdog_pair(timeout=30) as (me, peer):
        me.note("reduces the gradients of `out`")
        me.issued("reduce_scatter")
        peer.abandon("raised ValueError in engine.backward at optimizer step 2, micro-step 2 (boom)")
        message, waited = failed_wait(me, RanksDivergedError)
        assert waited < 5  # one poll, not the 30 s timeout
        assert (
            "rank 0 reduces the gradients of `out` (call 1) while rank 1 raised ValueError in "
            "engine.backward at optimizer step 2" in message
        )
        with pytest.raises(
            RanksDivergedError, match=r"rank 1 calls engine.step after it left the other ranks"
        ):
            peer.check_call("engine.step", 2, 2)  # no collective: refused before any
        assert peer.position().call == 0


def test_a_peer_that_closed_before_the_collective_is_named_at_once():
    with watchdog_pair(timeout=30) as (me, peer):
        peer.issued("all_gather")
        me.issued("all_gather")
        me.issued("all_gather")  # the peer never issues this one: it closed
        peer.close()
        with pytest.raises(
            RanksDivergedError, match=r"rank 1 closed its engine after call 1 \(ran fewer steps\)"
        ):
            me.wait(NeverDone())


def test_a_live_peer_outside_any_collective_is_named_stuck_not_diverged():
    with watchdog_pair(timeout=0.5) as (me, peer):
        peer.issued("all_gather")
        peer.publish()
        me.issued("all_gather")
        me.issued("all_gather")
        message, _ = failed_wait(me, CollectiveTimeoutError)
        assert "rank 1 is stuck outside any collective: alive (heartbeats on)" in message, message
        assert "ranks took different paths" not in message


class _SlowWork:
    """A work that completes after ``expiries`` timed waits expired, then returns or raises ``failure``."""

    def __init__(self, expiries, failure=None):
        self.expiries, self.failure, self.waits, self.done = expiries, failure, [], False

    def is_completed(self):
        return self.done

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.expiries and timeout is not None:
            self.expiries -= 1
            raise RuntimeError("Operation timed out!")
        self.done = True
        if self.failure is not None:
            raise self.failure


def test_wait_timed_carries_on_after_expired_waits_and_checks_between():
    from zero_comm.completion import wait_timed

    work, checked = _SlowWork(2), []
    wait_timed(work, 0.25, checked.append)
    assert len(checked) == 2 and all(w >= 0 for w in checked)
    assert [t.total_seconds() for t in work.waits] == [0.25, 0.25, 0.25]


def test_wait_timed_raises_the_works_own_failure_not_the_timeout():
    from zero_comm.completion import wait_timed

    work = _SlowWork(0, failure=RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_timed(work, 0.25)


def test_the_calls_since_the_last_check_are_compared_and_named():
    one, two = signature("engine.backward", 1, 1, 9, quiet=1), signature("engine.backward", 1, 1, 9, quiet=2)
    assert calls_differ(torch.stack([one, two])) and not calls_differ(torch.stack([two, two]))
    assert describe_call(1, two) == (
        "rank 1 calls engine.backward at optimizer step 1, micro-step 1 "
        "(after call 9; 2 unchecked engine calls since its last checked call)"
    )


class _RecordingChecks(CommWatchdog):
    """A watchdog whose call check records what it would exchange, and the collectives issued before."""

    __slots__ = ("checked",)

    def check_call(self, site, step, micro, group=None, *, quiet=0):
        self.checked.append((site, step, micro, quiet, self.position().call))


def test_a_deferred_call_is_checked_just_before_its_first_collective_or_never():
    from zero_comm.watched import activate, deactivate, watched_call

    wd = _RecordingChecks(dist.HashStore(), 0, 2, heartbeat_interval=0.05, check_calls=True)
    wd.checked = []
    try:
        wd.defer_call("engine.step", 3, 6, quiet=1)
        assert wd.position().what == "enters engine.step"  # what the peers read meanwhile
        assert wd.settle_call() and wd.checked == []  # no collective: never checked
        wd.defer_call("engine.step", 4, 8)
        token = activate(wd)
        try:
            for _ in range(2):
                watched_call("all_reduce", lambda t, async_op: Done(), torch.zeros(1))
        finally:
            deactivate(token)
        assert wd.checked == [("engine.step", 4, 8, 0, 0)]  # once, before the first collective
        assert not wd.settle_call() and wd.position().call == 2
        wd.check_calls = False
        wd.defer_call("engine.step", 5, 10)
        assert not wd.settle_call()  # off: nothing deferred
    finally:
        wd.close()
