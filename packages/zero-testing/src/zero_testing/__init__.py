"""(internal) Multi-process gloo test fixtures shared by every zero test suite.

* :class:`DistributedPool` / :class:`PoolRegistry`: live gloo ranks that run test
  functions, with failures and hangs reported as one clear pytest failure naming the rank.
* the ``dist`` pytest fixture (registered as a pytest plugin): ``dist.run(world_size, fn,
  *args, ranks_per_node=...)``.
* comparison helpers (:func:`assert_tensors_close`, :func:`assert_losses_close`, ...)
  and :func:`measure_wire_bytes` for the physical bytes a rank writes;
* :func:`captured_logs` and :func:`raised_message`: what a logger says and which error a
  call raises, inside a rank;
* :func:`failing_adamw`: an optimizer factory that raises :class:`InjectedFailure` mid-step.
"""

from zero_testing.capture import captured_logs, raised_message
from zero_testing.compare import (
    assert_losses_close,
    assert_state_close,
    assert_tensors_close,
    max_rel_to_magnitude,
)
from zero_testing.injected import InjectedFailure, failing_adamw
from zero_testing.pool import DistributedPool, PoolRegistry, RankFailure, RankInfo, RankTimeout
from zero_testing.wire import WireBytes, measure_wire_bytes, read_wchar

__all__ = [
    "DistributedPool",
    "InjectedFailure",
    "PoolRegistry",
    "RankFailure",
    "RankInfo",
    "RankTimeout",
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
