"""profile_step's attribution and cost fit, and growth's time prediction, on synthetic inputs."""

from __future__ import annotations

import pytest

from benchmarks.growth import predict
from benchmarks.kit.impls import ring_ideal_bytes, stage_of
from benchmarks.profile_step import (
    DDP_TOP,
    ZERO_TOP,
    _category,
    differences_table,
    fit_cost,
    op_differences,
    op_self_ms,
    waits_in_order,
    waits_table,
)


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


class _Range:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def elapsed_us(self) -> float:
        return self.end - self.start


class _Event:
    """The attributes of a ``torch.profiler`` FunctionEvent that profile_step reads (times in us)."""

    def __init__(
        self, name: str, start: float, end: float, parent: _Event | None = None, thread: int = 1
    ) -> None:
        self.name, self.cpu_parent, self.thread = name, parent, thread
        self.time_range = _Range(start, end)


def _step(at: float, first_wait_us: float, second_wait_us: float) -> list[_Event]:
    """One profiled step: a forward wait, a backward wait (with a nested wait), a step-phase wait."""
    top = _Event("bench.step", at, at + 10_000)
    fwd = _Event("zero.engine.forward", at, at + 3_000, top)
    bwd = _Event("zero.engine.backward", at + 3_000, at + 8_000, top)
    opt = _Event("zero.engine.step", at + 8_000, at + 10_000, top)
    fetch = _Event("zero.coord.fetch", at + 1_000, at + 1_000 + first_wait_us + 50, fwd)
    w1 = _Event("zero.params.gather.wait", at + 1_000, at + 1_000 + first_wait_us, fetch)
    w2 = _Event("zero.params.reduce_scatter_grads.wait", at + 5_000, at + 5_000 + second_wait_us, bwd)
    nested = _Event("zero.reduce_scatter.wait", at + 5_010, at + 5_020, w2)
    w3 = _Event("zero.params.gather.wait", at + 9_000, at + 9_100, opt)
    other_thread = _Event("zero.params.gather.wait", at + 2_000, at + 2_500, None, thread=2)
    # Out of order on purpose: positions come from the start within the step.
    return [w3, nested, top, fwd, bwd, opt, fetch, w2, w1, other_thread]


def test_the_waits_of_a_step_come_in_order_with_median_mean_and_max():
    events = _step(0.0, 400.0, 2_000.0) + _step(20_000.0, 600.0, 1_000.0) + _step(40_000.0, 800.0, 9_000.0)
    rows = waits_in_order(events)
    # Three outermost waits a step (the nested one and the other thread's are not counted).
    assert [(r["phase"], r["range"]) for r in rows] == [
        ("forward", "zero.params.gather.wait"),
        ("backward", "zero.params.reduce_scatter_grads.wait"),
        ("step", "zero.params.gather.wait"),
    ]
    assert [r["start_ms"] for r in rows] == pytest.approx([1.0, 5.0, 9.0])
    assert rows[0]["wait_ms"] == pytest.approx(0.6) and rows[0]["max_ms"] == pytest.approx(0.8)
    assert rows[1]["wait_ms"] == pytest.approx(2.0) and rows[1]["mean_ms"] == pytest.approx(4.0)
    table = waits_table([rows, rows[:2]])
    assert "| 0 | forward | `zero.params.gather.wait` | 1.0 | 0.60 (0.60, 0.8) | 0.60 (0.60, 0.8) |" in table
    # Rank 1 has no third wait.
    assert "| 2 | step | `zero.params.gather.wait` | 9.0 | 0.10 (0.10, 0.1) | - |" in table
    assert "|  | **all** |  |  | 2.7 (4.7) | 2.6 (4.6) |" in table  # medians (means) summed
    assert waits_in_order([]) == [] and waits_table([]) == ""


class _Timed(_Event):
    """An event with a self time (us), as ``op_self_ms`` reads it."""

    def __init__(self, name: str, self_us: float, parent: _Event | None = None, thread: int = 1) -> None:
        super().__init__(name, 0.0, self_us, parent, thread)
        self.self_cpu_time_total = self_us


def test_op_self_times_per_step_and_their_differences_from_ddp():
    events: list[_Event] = []
    for _ in range(2):  # two steps of each
        ddp_top, zero_top = _Timed(DDP_TOP, 100.0), _Timed(ZERO_TOP, 100.0)
        fwd = _Timed("zero.engine.forward", 300.0, zero_top)
        events += [ddp_top, zero_top, fwd]
        events += [_Timed("aten::mm", 4_000.0, ddp_top), _Timed("aten::mm", 4_200.0, fwd)]
        events += [_Timed("aten::copy_", 500.0, ddp_top), _Timed("aten::copy_", 2_500.0, fwd)]
        events += [_Timed("aten::aminmax", 1_000.0, fwd)]
        events += [_Timed("aten::mm", 9_000.0, None), _Timed("aten::mm", 9_000.0, zero_top, thread=2)]
    zero, ddp = op_self_ms(events, ZERO_TOP, 2), op_self_ms(events, DDP_TOP, 2)
    # Per step, only the training thread's events under each top; the tops themselves left out.
    assert zero == pytest.approx(
        {"zero.engine.forward": 0.3, "aten::mm": 4.2, "aten::copy_": 2.5, "aten::aminmax": 1.0}
    )
    assert ddp == pytest.approx({"aten::mm": 4.0, "aten::copy_": 0.5})
    rows = op_differences(zero, ddp, top=3)
    assert [(r["name"], round(r["diff_ms"], 6)) for r in rows] == [
        ("aten::copy_", 2.0),
        ("aten::aminmax", 1.0),
        ("zero.engine.forward", 0.3),
    ]
    table = differences_table(rows, sum(zero.values()), sum(ddp.values()))
    assert "| `aten::copy_` | 2.50 | 0.50 | +2.00 |" in table
    assert "| **all events of the step** | 8.0 | 4.5 | +3.5 |" in table
    assert op_self_ms([], ZERO_TOP, 2) == {} and differences_table([], 0.0, 0.0) == ""
