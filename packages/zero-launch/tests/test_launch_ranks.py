"""``zero_launch.launch``: results in rank order; a failing, dying or late rank named at once."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from zero_launch import LaunchError, RankContext, RankFailureKind, launch, pid_alive


def _sum_of_ranks(ctx: RankContext, offset: int) -> tuple[int, int, float, str]:
    value = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(value)
    return ctx.rank, dist.get_world_size(), value.item(), os.environ["LOCAL_WORLD_SIZE"]


@pytest.mark.smoke
@pytest.mark.parametrize("world", [1, 2, 3])
def test_results_come_back_in_rank_order_from_one_process_group(world):
    results = launch(_sum_of_ranks, world, 10, timeout=120, name="t-launch")
    want_sum = float(sum(range(10, 10 + world)))
    assert [r.rank for r in results] == list(range(world))
    assert [r.value for r in results] == [(r, world, want_sum, str(world)) for r in range(world)]
    assert all(r.seconds > 0 for r in results)


def _progress_then_answer(ctx: RankContext) -> int:
    for step in range(3):
        ctx.send((step, os.getpid()))
    return ctx.rank * 7


def test_progress_reports_reach_the_parent_in_order():
    seen: list[tuple[int, int]] = []
    results = launch(
        _progress_then_answer,
        2,
        timeout=120,
        process_group=False,
        on_message=lambda rank, payload: seen.append((rank, payload[0])),
    )
    assert [r.value for r in results] == [0, 7]
    for rank in (0, 1):
        assert [step for r, step in seen if r == rank] == [0, 1, 2]


def _pid_then_raise_on_one(ctx: RankContext) -> None:
    ctx.send(os.getpid())
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))  # fails once rank 1 has left: named after rank 1
    time.sleep(300)  # rank 2 (and rank 0 if its collective does not fail): the launcher kills it


def test_a_rank_that_raises_is_named_with_its_exception_and_the_others_are_killed():
    pids: dict[int, int] = {}
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(
            _pid_then_raise_on_one,
            3,
            timeout=300,
            on_message=lambda rank, pid: pids.__setitem__(rank, pid),
        )
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1 and err.failures[0].kind is RankFailureKind.RAISED
    assert "rank 1 raised ValueError: boom on purpose" in str(err)
    assert "Traceback" in err.traceback and "boom on purpose" in err.traceback
    assert 2 in err.still_running and 1 not in err.still_running
    assert f"rank(s) {list(err.still_running)} were still running and have been killed" in str(err)
    assert elapsed < 60  # far below the 300 s timeout: the failure ended the launch
    assert sorted(pids) == [0, 1, 2] and not any(map(pid_alive, pids.values()))


def _one_rank_dies(ctx: RankContext, how: str) -> int:
    if ctx.rank == ctx.world_size - 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)  # the launcher must not wait for this
    return ctx.rank


@pytest.mark.parametrize(
    ("how", "kind", "text"),
    [
        ("exit", RankFailureKind.EXITED, "rank 2 exited (code 3)"),
        ("kill", RankFailureKind.SIGNALED, "rank 2 was killed by SIGKILL (9)"),
    ],
)
def test_a_rank_that_dies_is_named_with_its_exit_code_or_signal(how, kind, text):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_one_rank_dies, 3, how, timeout=300, process_group=False)
    failure = info.value.failures[0]
    assert (failure.rank, failure.kind, failure.traceback) == (2, kind, "")
    assert failure.exit_code == (3 if how == "exit" else -signal.SIGKILL)
    assert str(info.value).startswith(f"zero failed: {text}")
    assert info.value.still_running == (0, 1)
    assert time.monotonic() - start < 60


def _rank_one_is_late(ctx: RankContext) -> int:
    if ctx.rank == 1:
        time.sleep(300)
    return ctx.rank


def test_the_deadline_names_the_ranks_still_running():
    # The deadline only has to outlast rank 0's start (a spawn importing torch: ~2 s idle, ~10 s
    # on a loaded host) for the usual case below; when it does not, both ranks are named, which
    # the first assertions also check. Rank 1 sleeps far beyond it, so the kill is what ends the test.
    deadline = 10
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank_one_is_late, 2, timeout=deadline, process_group=False, name="late")
    err = info.value
    assert all(f.kind is RankFailureKind.TIMED_OUT for f in err.failures)
    assert 1 in err.still_running and f"still running after {deadline} s" in str(err)
    if 0 in err.results:  # rank 0 started within the deadline (the usual case): only rank 1 is named
        assert err.still_running == (1,) and err.results[0].value == 0
        assert f"late failed: rank 1 still running after {deadline} s" in str(err)
    assert time.monotonic() - start < 2 * deadline + 10


def test_a_ranks_per_node_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="ranks_per_node=2 must be >= 1 and divide world=3"):
        launch(_sum_of_ranks, 3, 0, timeout=10, ranks_per_node=2)
