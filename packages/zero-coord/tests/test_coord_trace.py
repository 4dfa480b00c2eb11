"""Traces: recorded on the first step, validated after, invalidated once (one log line) on change."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from coord_cases import (
    DeepMLP,
    ReduceScatterSink,
    SwappableMLP,
    build,
    capture_coord_logs,
    coordinate,
    over_worlds,
    rank_input,
    release_logs,
)

from zero_coord import CoordinatorConfig, Phase, Trace, TraceEvent, TraceState

PREFETCHING = CoordinatorConfig(prefetch_bucket_size=200, max_reuse_distance=0)


def _order_change(rank):
    model, ref = build(SwappableMLP)
    coord = coordinate(model, PREFETCHING, ReduceScatterSink())
    trace = coord.trace(Phase.TRAIN)
    handler = capture_coord_logs()
    states, hits, out_errors = [trace.state.name], [], []
    # steps 0-1: plain order; 2: swapped (diverges); 3: swapped (records); 4-5: swapped (validated)
    for step, swap in enumerate([False, False, True, True, True, True]):
        model.swap = ref.swap = swap
        x = rank_input(step, rank.rank, (3, 9))
        out = model(x)
        states.append(trace.state.name)  # after forward, before backward
        out.sum().backward()
        states.append(trace.state.name)
        hits.append(coord.last_step_stats.prefetch_hits)
        with torch.no_grad():
            out_errors.append((out - ref(x)).abs().max().item())
    records = release_logs(handler)
    events = [(e.module, e.backward) for e in trace.events]
    total = coord.total_stats
    coord.remove()
    return states, records, events, hits, max(out_errors), total.trace_invalidations, total.steps


@over_worlds
def test_a_changed_module_order_invalidates_once_with_one_log_line(dist, world):
    for r, (states, records, events, hits, out_err, invalidations, steps) in enumerate(
        dist.run(world, _order_change)
    ):
        assert out_err == 0.0
        assert states == [
            "RECORD",
            "RECORD", "COMPLETE",  # step 0 records until backward ends
            "COMPLETE", "COMPLETE",  # step 1 validates
            "INVALID", "INVALID",  # step 2 diverges in forward
            "RECORD", "COMPLETE",  # step 3 records the new order
            "COMPLETE", "COMPLETE",  # steps 4-5 validate
            "COMPLETE", "COMPLETE",
        ], (r, states)  # fmt: skip
        assert len(records) == 1, (r, records)
        level, message = records[0]
        assert level == "INFO"
        assert "'layers.2' (forward) ran where 'layers.1' (forward) was expected" in message, message
        assert "TRAIN" in message and "set_leaf_modules" in message
        assert invalidations == 1 and steps == 6
        forward = [f"layers.{i}" for i in (0, 2, 1, 3)]
        assert events == [(m, False) for m in forward] + [(m, True) for m in reversed(forward)]
        # prefetch works on validated steps only
        assert hits[0] == 0 and hits[1] > 0 and hits[3] == 0 and hits[4] > 0 and hits[5] == hits[4], hits


def _alternating_phases(rank):
    model, ref = build(DeepMLP, depth=4, width=5)
    coord = coordinate(model, PREFETCHING, ReduceScatterSink())
    handler = capture_coord_logs()
    phases, errors, eval_hits, live_after_eval = [], [], [], []
    for step in range(4):
        x = rank_input(step, rank.rank, (2, 5))
        model.train()
        model(x)  # a training-mode forward without backward (abandoned, e.g. a logging pass)
        model(x).sum().backward()
        phases.append(coord.last_step_stats.phase.name)
        with torch.no_grad():
            out = model(x)
            errors.append((out - ref(x)).abs().max().item())
        phases.append(coord.last_step_stats.phase.name)
        eval_hits.append(coord.last_step_stats.prefetch_hits)
        live_after_eval.append(coord.live_elements)
        model.eval()
        model(x)  # eval mode with autograd on: an EVAL step as well
        phases.append(coord.last_step_stats.phase.name)
        eval_hits.append(coord.last_step_stats.prefetch_hits)
    model.train()
    records = release_logs(handler)
    train, evaluation = coord.trace(Phase.TRAIN), coord.trace(Phase.EVAL)
    result = (
        phases,
        records,
        train.state.name,
        evaluation.state.name,
        [e.backward for e in train.events],
        [e.backward for e in evaluation.events],
        coord.total_stats.trace_invalidations,
        max(errors),
        eval_hits,
        live_after_eval,
    )
    coord.remove()
    return result


@over_worlds
def test_alternating_train_and_eval_keeps_both_traces_complete(dist, world):
    for result in dist.run(world, _alternating_phases):
        phases, records, train_state, eval_state, train_bwd, eval_bwd, invalidations, err, hits, live = result
        assert records == [] and invalidations == 0
        assert train_state == eval_state == "COMPLETE"
        assert train_bwd == [False] * 4 + [True] * 4
        assert eval_bwd == [False] * 4
        assert phases == ["TRAIN", "EVAL", "EVAL"] * 4
        assert err == 0.0
        assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits  # the first eval step records
        assert live == [0] * 4  # an eval step releases everything at the root's post-forward


def test_trace_lifecycle_in_process():
    class Slot:
        def __init__(self, index, numel):
            self.index, self.numel = index, numel

    a, b, c = Slot(0, 5), Slot(1, 7), Slot(2, 11)
    module_slots = [(), (a,), (b, c), (a, c)]
    trace = Trace(Phase.TRAIN, "", ["", "x", "y", "z"])
    assert trace.state is TraceState.RECORD and len(trace) == 0
    assert trace.begin_step() is False
    for code in [1 << 1, 2 << 1, 3 << 1, (3 << 1) | 1]:
        trace.record(code)
    assert trace.plan is None
    trace.complete(module_slots)
    assert trace.state is TraceState.COMPLETE
    assert trace.events == (
        TraceEvent("x", False),
        TraceEvent("y", False),
        TraceEvent("z", False),
        TraceEvent("z", True),
    )
    plan = trace.plan
    assert plan.codes == (2, 4, 6, 7) and plan.event_slots == ((a,), (b, c), (a, c), (a, c))
    assert plan.cum_numel == (0, 5, 23, 39, 55)
    assert dict(plan.uses) == {0: (0, 2, 3), 1: (1,), 2: (1, 2, 3)}
    assert [plan.next_use(0, cursor) for cursor in range(5)] == [0, 2, 2, 3, None]
    assert plan.next_use(7, 0) is None  # a slot no event fetches
    assert [plan.matches(1, code) for code in (4, 5, 6)] == [True, False, False]
    assert not plan.matches(4, 2)  # past the recorded order
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.codes = ()
    with pytest.raises(TypeError):
        plan.uses[0] = ()
    with pytest.raises(RuntimeError, match="only a recording trace records"):
        trace.record(2)
    assert trace.divergence(1, 6) == (
        "TRAIN trace of '<root>' (event 1 of 4) diverged: "
        "module 'z' (forward) ran where 'y' (forward) was expected"
    )
    assert trace.departure(1, 6) == "runs `z` (forward) where its recorded order has 'y' (forward)"
    assert trace.divergence(4, 3) == (
        "TRAIN trace of '<root>' (event 4 of 4) diverged: "
        "module 'x' (backward) ran after the recorded order ended"
    )
    assert trace.departure(4, 3) == "runs `x` (backward) where its recorded order ended"
    assert trace.divergence(2, None).endswith("the step ended where 'z' (forward) was expected next")
    assert trace.departure(2, None) == "ends its step where its recorded order has 'z' (forward) next"
    assert trace.begin_step() is True  # a complete trace validates the next step
    assert trace.invalidate("first") is True and trace.state is TraceState.INVALID
    assert trace.plan is None
    assert trace.begin_step() is False and trace.state is TraceState.RECORD and len(trace) == 0
    assert trace.invalidate("second") is False  # only the first divergence is logged at INFO
    assert trace.invalidate(None) is False and trace.invalidations == 2  # user request: not counted
    assert TraceEvent("", True).describe() == "'<root>' (backward)"


@pytest.mark.parametrize(
    "field", ["prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"], ids=lambda f: f
)
@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"], ids=repr)
def test_config_rejects_bad_values_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=f"CoordinatorConfig.{field} must be a non-negative int"):
        CoordinatorConfig(**{field: bad})
    assert getattr(CoordinatorConfig(**{field: 0}), field) == 0
