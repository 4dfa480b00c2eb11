"""zero-launch: local gloo ranks for zero's CLI, demos, benchmarks and test pools.

:func:`launch` runs a module-level function on spawned local processes that share a gloo process
group and returns each rank's value in rank order; a rank that raises, dies or outlives the
deadline is named at once and the others are killed. :class:`RankGroup` is the process group
underneath, for callers that talk to their ranks (the test pool of zero-testing).
"""

from __future__ import annotations

from zero_launch import pids, ranks
from zero_launch.pids import pid_alive
from zero_launch.ranks import (
    LaunchError,
    RankAnswer,
    RankContext,
    RankFailure,
    RankFailureKind,
    RankGroup,
    launch,
    send_failure,
)

__all__ = [*pids.__all__, *ranks.__all__]
