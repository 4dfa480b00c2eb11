"""profile_step's attribution and cost fit, and growth's time prediction, on synthetic inputs."""

from __future__ import annotations

import pytest
from growth import predict
from impls import ring_ideal_bytes, stage_of
from profile_step import _category, fit_cost


def test_the_cost_fit_recovers_latency_and_cost_per_byte():
    rows = [{"wire_bytes": b, "seconds": 2e-4 + b * 3e-9} for b in (1 << 16, 1 << 18, 1 << 20, 1 << 22)]
    latency, cost = fit_cost(rows)
    assert latency == pytest.approx(2e-4) and cost == pytest.approx(3e-9)


@pytest.mark.parametrize(
    "chain,category",
    [
        (["aten::mm", "zero.engine.forward", "bench.step"], "compute forward"),
        (["aten::mm", "AddmmBackward0", "zero.engine.backward", "bench.step"], "compute backward"),
        (["c10d::_allgather_base_", "zero.all_gather.issue", "zero.params.gather", "bench.step"], None),
        (["zero.params.gather.wait", "zero.coord.fetch", "zero.engine.forward"], "waiting for collectives"),
        (
            ["aten::copy_", "zero.all_gather.finish", "zero.params.gather.wait"],
            "zero copies / casts / local sums",
        ),
        (["aten::copy_", "zero.engine.forward"], "compute forward"),
        (["zero.coord.fetch", "zero.engine.forward", "bench.step"], "hooks and coordinator (Python)"),
        (["aten::add_", "zero.optim.sub_group_step", "zero.optim.step", "zero.engine.step"], "optimizer"),
        (["aten::zero_", "zero.engine.step", "bench.step"], "step: other (zero_grad, checks)"),
    ],
)
def test_self_time_goes_to_the_innermost_range(chain, category):
    expected = category if category is not None else "collective calls (issue / synchronous)"
    assert _category(chain) == expected


def test_growth_predicts_compute_plus_ring_bytes():
    rows = [
        {"impl": "ddp", "workload": "1M", "world": 1, "psi": 1000, "step_s": 0.01},
        {"impl": "zero-3", "workload": "1M", "world": 2, "psi": 1000, "step_s": 0.02},
    ]
    predict(rows, {2: 1e-9})
    assert rows[0]["predicted_step_s"] == pytest.approx(0.01)
    assert rows[1]["predicted_step_s"] == pytest.approx(0.01 + ring_ideal_bytes("zero-3", 1000, 2) * 1e-9)
    assert stage_of("zero-3-compiled") == 3
