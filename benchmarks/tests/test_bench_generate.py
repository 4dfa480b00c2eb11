"""Pure helpers of the generate benchmark: token rate, slowest-rank median, summary."""

from __future__ import annotations

import pytest

from benchmarks.generate import WAYS, slowest_median, summarize, tokens_per_second


def test_tokens_per_second_counts_every_sequence_of_the_batch():
    assert tokens_per_second(batch=2, new_tokens=64, seconds=0.5) == 256.0
    with pytest.raises(ValueError, match="positive"):
        tokens_per_second(1, 64, 0.0)


def test_slowest_median_takes_the_slowest_rank_of_each_run_then_the_median():
    # run 0: max 3, run 1: max 5, run 2: max 1 -> median 3
    assert slowest_median([[1.0, 5.0, 1.0], [3.0, 2.0, 0.5]]) == 3.0
    with pytest.raises(ValueError, match="same number of runs"):
        slowest_median([[1.0], [1.0, 2.0]])


def test_summary_speedup_is_per_token_time_over_gathered_time():
    rows = [
        {"way": WAYS[0], "seconds_median": 3.0, "all_gathers": 640},
        {"way": WAYS[1], "seconds_median": 1.5, "all_gathers": 1},
    ]
    assert summarize(rows) == {
        "speedup": 2.0,
        "all_gathers_per_token_way": 640,
        "all_gathers_gathered_once": 1,
    }
