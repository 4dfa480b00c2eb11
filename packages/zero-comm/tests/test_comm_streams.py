"""CommStreams: the order of stream and event calls around a gather and a reduce-scatter,
on a recording double; NoStreams and the choice of comm_streams on CPU."""

from __future__ import annotations

import pytest
import torch

from zero_comm import NO_STREAMS, CommStreams, NoStreams, comm_streams
from zero_comm.streams import run_on
from zero_testing import RecordingStreamSource


def test_gather_runs_on_the_gather_stream_after_compute_and_compute_waits_on_its_event():
    source = RecordingStreamSource()
    streams = CommStreams(source)
    log = source.log

    def issue():
        log.append(("issue", source.current.name))
        return "handle"

    handle, event = streams.gather(issue)
    log.append(("use",))
    streams.wait(event)
    assert handle == "handle"
    assert log == [
        ("wait_stream", "gather", "compute"),
        ("enter", "gather"),
        ("issue", "gather"),
        ("enter", "compute"),
        ("record", "gather", "gather#1"),
        ("use",),
        ("wait_event", "compute", "gather#1"),
    ]
    assert source.current is source.compute


def test_run_on_issues_on_the_stream_and_restores_whichever_was_current():
    source = RecordingStreamSource(("side", "other"))
    side, other = source.new_stream(), source.new_stream()

    def inner():
        source.log.append(("issue", source.current.name))
        return 7

    assert run_on(source, side, lambda: run_on(source, other, inner) + 1) == 8
    assert source.log == [
        ("enter", "side"),
        ("enter", "other"),
        ("issue", "other"),
        ("enter", "side"),
        ("enter", "compute"),
    ]
    source.log.clear()

    def fails():
        raise RuntimeError("issue failed")

    with pytest.raises(RuntimeError, match="issue failed"):
        run_on(source, side, fails)
    assert source.log == [("enter", "side"), ("enter", "compute")] and source.current is source.compute


def test_gather_restores_the_compute_stream_when_the_issue_raises():
    source = RecordingStreamSource()
    streams = CommStreams(source)

    def issue():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        streams.gather(issue)
    assert source.current is source.compute
    assert source.log[-1] == ("enter", "compute")


def _reduce_calls(i: int) -> list[tuple]:
    """The log of reduction ``i`` (from 0): the reduce stream waits on grad-ready, issues, records."""
    return [
        ("record", "compute", f"compute#{i + 1}"),  # grad-ready
        ("wait_event", "reduce", f"compute#{i + 1}"),
        ("enter", "reduce"),
        ("reduce_scatter", i, "reduce"),
        ("enter", "compute"),
        ("record", "reduce", f"reduce#{i + 1}"),
    ]


def test_reduce_waits_on_grad_ready_and_keeps_inputs_until_compute_waits():
    source = RecordingStreamSource()
    streams = CommStreams(source, keep=2)
    log = source.log
    for i in range(3):
        streams.reduce(lambda i=i: log.append(("reduce_scatter", i, source.current.name)), inputs=[i])
    kept = [inputs for inputs, _ in streams._pending]
    streams.wait_reduced()
    assert kept == [[1], [2]]  # the oldest was released after compute waited on it
    assert not streams._pending
    assert log == [
        *_reduce_calls(0),
        *_reduce_calls(1),
        *_reduce_calls(2),
        ("wait_event", "compute", "reduce#1"),  # over keep=2: compute waits on the oldest
        ("wait_event", "compute", "reduce#3"),  # wait_reduced: the last subsumes the others
    ]
    streams.wait_reduced()  # nothing pending: no call
    assert log[-1] == ("wait_event", "compute", "reduce#3")


def test_no_streams_runs_the_work_and_orders_nothing():
    calls = []
    handle, event = NO_STREAMS.gather(lambda: calls.append("gather") or "h")
    assert (handle, event) == ("h", None)
    assert NO_STREAMS.reduce(lambda: calls.append("reduce") or "r", inputs=[1]) == "r"
    NO_STREAMS.wait(None)
    NO_STREAMS.wait_reduced()
    assert calls == ["gather", "reduce"]
    assert isinstance(NO_STREAMS, NoStreams) and not NO_STREAMS.active


def test_comm_streams_is_the_no_op_on_cpu():
    assert comm_streams(torch.device("cpu")) is NO_STREAMS


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_keep_must_be_a_positive_integer(keep):
    with pytest.raises(ValueError, match="keep"):
        CommStreams(RecordingStreamSource(), keep=keep)
