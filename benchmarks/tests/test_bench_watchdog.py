"""The watchdog A/B summary: medians of each arm, overhead and per-pair ratio."""

from __future__ import annotations

import pytest

from benchmarks.watchdog_overhead import median_interval, summarize


def test_overhead_is_the_ratio_of_the_medians_and_pairs_are_matched_in_order():
    times = {"on": [0.103, 0.5, 0.102, 0.104], "off": [0.1, 0.1, 0.1, 0.1]}
    found = summarize(times)
    assert found["median_on_s"] == pytest.approx(0.1035)
    assert found["median_off_s"] == pytest.approx(0.1)
    assert found["overhead"] == pytest.approx(0.035)
    assert found["median_pair_ratio"] == pytest.approx(1.035)  # the 5x outlier pair does not move it
    assert found["pairs"] == 4


def test_the_check_timed_alone_gives_its_share_of_the_step():
    times = {"on": [0.1, 0.1], "off": [0.1, 0.1], "check": [0.0002, 0.0001, 0.0009]}
    found = summarize(times, checks_per_step=3)
    assert found["median_check_s"] == pytest.approx(0.0002)
    assert found["checks_per_step"] == 3  # counted by the run: collectives per step, on minus off
    assert found["direct_share"] == pytest.approx(3 * 0.0002 / 0.1)
    assert "direct_share" not in summarize({"on": [0.1], "off": [0.1]})


def test_the_median_pair_ratio_comes_with_a_bootstrap_interval_around_it():
    assert median_interval([1.02] * 50) == (1.02, 1.02)  # no spread, no range
    spread = [1.0 + 0.001 * (i - 100) for i in range(201)]  # 0.90 .. 1.10, median 1.00
    low, high = median_interval(spread)
    assert low < 1.0 < high and high - low < 0.05
    assert median_interval(spread) == (low, high)  # seeded: the published interval is reproducible
    times = {"on": [0.103, 0.5, 0.102, 0.104], "off": [0.1, 0.1, 0.1, 0.1]}
    low, high = summarize(times)["pair_ratio_interval"]
    assert 1.019 < low <= 1.035 <= high <= 5.0  # ratios 1.02, 1.03, 1.04 and the 5x outlier


@pytest.mark.parametrize("check", ["watchdog", "calls"])
def test_both_ab_runs_finish_and_write_their_report(tmp_path, check):
    # The watchdog A/B's "off" engine has no watchdog: the run must not ask it for collectives.
    import json

    from benchmarks.watchdog_overhead import main

    main(
        [
            "--quick",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--pairs",
            "2",
            "--check",
            check,
            "--out",
            str(tmp_path),
        ]
    )
    (written,) = tmp_path.glob("*.json")
    result = json.loads(written.read_text())
    assert result["args"]["check"] == check and result["pairs"] == 2 and result["median_off_s"] > 0
