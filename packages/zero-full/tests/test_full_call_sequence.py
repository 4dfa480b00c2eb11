"""The engine-call prediction: which checked call followed which, replayed (no process group)."""

from __future__ import annotations

from zero_full.guards.calls import CallSequence, Prediction

H, N, B = Prediction.HOLDS, Prediction.NONE, Prediction.BROKEN


def _run(sequence: CallSequence, calls: list[tuple[str, int, int, int]]) -> list[Prediction]:
    return [sequence.predict(*call)[0] for call in calls]


def _step(step: int, accumulation: int, quiet: int = 0) -> list[tuple[str, int, int, int]]:
    """The checked calls of one optimizer step at stage 3: forward and backward per micro-step, the step."""
    first = step * accumulation
    calls = []
    for m in range(accumulation):
        calls += [("engine.forward", quiet, step, first + m), ("engine.backward", 0, step, first + m)]
    return [*calls, ("engine.step", 0, step, first + accumulation)]


def test_after_the_first_steps_every_call_is_predicted_with_gradient_accumulation():
    seq = CallSequence()
    assert _run(seq, _step(0, 2)) == [N] * 5  # nothing recorded
    assert _run(seq, _step(1, 2)) == [N, H, H, H, H]  # what follows the step is new once
    for step in range(2, 6):  # a backward followed by the next forward or by the step: told apart
        assert _run(seq, _step(step, 2)) == [H] * 5


def test_a_save_every_few_steps_breaks_the_prediction_twice_not_the_steps_between():
    seq = CallSequence()
    for step in range(3):
        _run(seq, _step(step, 1))
    save = ("engine.save_checkpoint", 0, 3, 3)
    assert _run(seq, [save]) == [B]  # the step was followed by a forward
    assert _run(seq, _step(3, 1)) == [N, H, H]  # nothing followed a save yet: exchanged
    assert _run(seq, _step(4, 1)) == [B, H, H]  # the step was last followed by the save
    assert _run(seq, [("engine.save_checkpoint", 0, 5, 5)]) == [B]
    assert _run(seq, _step(5, 1)) == [H, H, H]  # now known after a save


def test_a_call_with_other_unchecked_calls_before_it_breaks_the_prediction():
    seq = CallSequence()
    for step in range(3):
        _run(seq, _step(step, 1, quiet=1))  # below stage 3: the forward before is unchecked
    prediction, expected = seq.predict("engine.forward", 2, 3, 3)
    assert prediction is B and expected == ("engine.forward", 1, 0)
