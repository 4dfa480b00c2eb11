"""(internal) Multi-process gloo test fixtures shared by every zero test suite."""

from zero_testing.capture import captured_logs, raised_message
from zero_testing.compare import (
    assert_losses_close,
    assert_state_close,
    assert_tensors_close,
    max_rel_to_magnitude,
)
from zero_testing.copies import CopyLog
from zero_testing.injected import InjectedFailure, failing_adamw
from zero_testing.pool import DistributedPool, PoolRegistry, RankFailure, RankInfo, RankTimeout
from zero_testing.streams import RecordingEvent, RecordingStream, RecordingStreamSource
from zero_testing.wire import WireBytes, measure_wire_bytes, read_wchar

__all__ = [
    "CopyLog",
    "DistributedPool",
    "InjectedFailure",
    "PoolRegistry",
    "RankFailure",
    "RankInfo",
    "RankTimeout",
    "RecordingEvent",
    "RecordingStream",
    "RecordingStreamSource",
    "WireBytes",
    "assert_losses_close",
    "assert_state_close",
    "assert_tensors_close",
    "captured_logs",
    "failing_adamw",
    "max_rel_to_magnitude",
    "measure_wire_bytes",
    "raised_message",
    "read_wchar",
]
