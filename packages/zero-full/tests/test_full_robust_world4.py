"""World 4: rank agreement names the differing rank among four; a NaN on one rank is handled on all four."""

from __future__ import annotations

import pytest
import torch

import zero_full
from zero_testing import captured_logs
from zero_testing.models import TanhMLP

WORLD = 4


def _net(hidden: int = 13) -> TanhMLP:
    return TanhMLP(11, hidden, 3)


def _config(stage: int = 3, **extra) -> dict:
    return {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
        "robustness": {"comm_timeout": 30, "heartbeat_interval": 0.5},
        **extra,
    }


def _data(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(6, 11, generator=g).to(dtype), torch.randn(6, 3, generator=g).to(dtype)


# --------------------------------------------------------------------------- agreement at initialize


def _hidden_differs_on_rank_2(rank):
    try:
        engine = zero_full.initialize(_net(64 + (rank.rank == 2)), _config())
    except zero_full.RankMismatchError as exc:
        return str(exc)
    engine.close()
    return None


def test_a_different_model_on_one_rank_of_four_names_that_rank(dist):
    for message in dist.run(WORLD, _hidden_differs_on_rank_2):
        assert message is not None and "parameter 'a.weight' differs on rank(s) 2 from rank 0" in message
        assert "rank 2: shape (65, 11)" in message and "rank 0: shape (64, 11)" in message, message


# --------------------------------------------------------------------------- a NaN on one rank


def _nan_on_rank_3(rank, precision, policy):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config = _config()
    config["robustness"]["nonfinite_gradients"] = policy
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine = zero_full.initialize(_net(), config)
    error = None
    with captured_logs("zero.engine") as warnings:
        for step in range(3):
            x, y = _data(step, rank.rank, dtype)
            if step == 1 and rank.rank == 3:
                x[0, 0] = float("nan")
            engine.backward(engine(x, y))
            if step == 1:
                before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
            try:
                engine.step()
            except zero_full.NonFiniteGradientError as exc:
                error = str(exc)
                break
            if step == 1:
                after = engine.consolidated_state_dict()
                unchanged = all(torch.equal(before[k], after[k]) for k in before)
    finite = all(bool(torch.isfinite(t).all()) for t in engine.consolidated_state_dict().values())
    result = {
        "error": error,
        "warnings": [m for m in warnings if "non-finite" in m],
        "skipped": engine.stats.skipped_steps,
        "finite": finite,
        "unchanged": unchanged if error is None else None,
    }
    engine.close()
    return result


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_on_one_rank_of_four_skips_the_step_on_all_four(dist, precision):
    results = dist.run(WORLD, _nan_on_rank_3, precision, "skip")
    for r, res in enumerate(results):
        assert res["error"] is None and res["skipped"] == 1 and res["finite"] and res["unchanged"], res
        assert len(res["warnings"]) == (1 if r == 0 else 0), res
    assert "on rank 3" in results[0]["warnings"][0] and "step 2" in results[0]["warnings"][0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_on_one_rank_of_four_raises_on_all_four(dist, precision):
    for res in dist.run(WORLD, _nan_on_rank_3, precision, "raise"):
        assert res["error"] is not None and "on rank 3" in res["error"], res
        assert "nonfinite_gradients" in res["error"]
