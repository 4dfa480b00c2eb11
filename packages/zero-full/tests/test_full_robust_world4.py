"""World 4: rank agreement names the differing rank among four; a NaN on one rank is handled on all four."""

from __future__ import annotations

import pytest
from test_full_robustness import _config, _nan_on_last_rank, _net

import zero_full

WORLD = 4
ROBUST = {"comm_timeout": 30, "heartbeat_interval": 0.5}


# --------------------------------------------------------------------------- agreement at initialize


def _hidden_differs_on_rank_2(rank):
    try:
        engine = zero_full.initialize(_net(64 + (rank.rank == 2)), _config(robustness=ROBUST))
    except zero_full.RankMismatchError as exc:
        return str(exc)
    engine.close()
    return None


def test_a_different_model_on_one_rank_of_four_names_that_rank(dist):
    for message in dist.run(WORLD, _hidden_differs_on_rank_2):
        assert message is not None and "parameter 'a.weight' differs on rank(s) 2 from rank 0" in message
        assert "rank 2: shape (65, 11)" in message and "rank 0: shape (64, 11)" in message, message


# --------------------------------------------------------------------------- a NaN on one rank


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_on_one_rank_of_four_skips_the_step_on_all_four(dist, precision):
    results = dist.run(WORLD, _nan_on_last_rank, precision, "skip", 0.0, 3, 1, ROBUST)
    for r, res in enumerate(results):
        assert res["error"] is None and res["skipped"] == 1 and res["finite"] and res["unchanged"], res
        assert len(res["warnings"]) == (1 if r == 0 else 0), res
    assert "on rank 3" in results[0]["warnings"][0] and "step 2" in results[0]["warnings"][0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_on_one_rank_of_four_raises_on_all_four(dist, precision):
    for res in dist.run(WORLD, _nan_on_last_rank, precision, "raise", 0.0, 3, 1, ROBUST):
        assert res["error"] is not None and "on rank 3" in res["error"], res
        assert "nonfinite_gradients" in res["error"]
