"""The waits benchmark's summary: phases by start time, positions across steps and ranks, phase sums."""

from __future__ import annotations

import pytest

from benchmarks.waits import _phase, phase_totals, positions


def _wait(phase: str, op: str, lead: float, wait: float) -> dict:
    return {"phase": phase, "op": op, "what": f"{op} for {phase}", "lead_ms": lead, "wait_ms": wait}


def test_a_wait_belongs_to_the_phase_it_started_in():
    bounds = (0.0, 1.0, 3.0, 4.0)
    assert [_phase(t, bounds) for t in (0.0, 0.99, 1.0, 2.5, 3.0, 3.99)] == [
        "forward",
        "forward",
        "backward",
        "backward",
        "step",
        "step",
    ]


def test_positions_take_the_kth_wait_of_every_step_and_rank():
    rank0 = [
        {
            "step_ms": 10.0,
            "waits": [_wait("forward", "all_gather", 1.0, 2.0), _wait("step", "all_gather", 0.0, 1.0)],
        },
        {
            "step_ms": 11.0,
            "waits": [_wait("forward", "all_gather", 3.0, 4.0), _wait("step", "all_gather", 0.0, 3.0)],
        },
        {
            "step_ms": 12.0,
            "waits": [_wait("forward", "all_gather", 2.0, 9.0), _wait("step", "all_gather", 0.0, 2.0)],
        },
    ]
    rank1 = [
        {
            "step_ms": 10.0,
            "waits": [_wait("forward", "all_gather", 1.0, 0.5), _wait("step", "all_gather", 0, 1.0)],
        },
        {"step_ms": 10.0, "waits": [_wait("forward", "all_gather", 1.0, 0.5)]},  # one wait fewer
        {
            "step_ms": 10.0,
            "waits": [_wait("forward", "all_gather", 1.0, 1.5), _wait("step", "all_gather", 0, 1.0)],
        },
    ]
    rows = positions([rank0, rank1])
    assert len(rows) == 1  # as many positions as the fewest waits of any step
    (row,) = rows
    assert (row["position"], row["phase"], row["op"]) == (0, "forward", "all_gather")
    assert row["lead_ms"] == 2.0  # rank 0's median lead
    assert row["wait_median_ms"] == [4.0, 0.5]
    assert row["wait_mean_ms"] == pytest.approx([5.0, 2.5 / 3])
    assert row["wait_max_ms"] == [9.0, 1.5]


def test_phase_totals_are_medians_of_per_step_sums():
    steps = [
        {"step_ms": 1.0, "waits": [_wait("forward", "a", 0, 1.0), _wait("forward", "a", 0, 2.0)]},
        {"step_ms": 1.0, "waits": [_wait("forward", "a", 0, 5.0), _wait("backward", "b", 0, 1.0)]},
        {"step_ms": 1.0, "waits": [_wait("forward", "a", 0, 4.0)]},
    ]
    assert phase_totals([steps]) == {"forward": [4.0], "backward": [0.0], "step": [0.0]}
