"""Engine calls compared across ranks; a rank whose forward or backward failed alone is stopped.

Ranks that make different engine calls (``engine.consolidated_state_dict()`` under ``if rank
== 0:``, a save after one batch less, a backward that raised on one rank and was caught)
would issue collectives of different sizes, which gloo answers with a C++ abort naming
nothing. :class:`CallGuard` starts each engine call that communicates with
:meth:`zero_comm.CommWatchdog.check_call` (one all-gather of a fixed 64-byte signature, so the
first differing call meets the peers' signature, never a payload of another size) and, when a
forward or backward raises, tells the peers through the watchdog (:meth:`~zero_comm.CommWatchdog.abandon`):
they raise naming this rank's call site, and this rank issues no further collective.

A call that issues no collective in this configuration (a forward below stage 3, a backward
that only accumulates gradients) is not checked: it cannot be paired with another rank's
collective, and every call that does communicate is checked before its first collective, so
after any difference each rank's next collective is a signature. The optimizer step is
checked lazily, just before its first collective: a stage-3 step without clipping issues
none, and checking it would line the ranks up for nothing. Such *quiet* calls are counted,
and the count since the last check goes into the next signature: a rank that skipped a
forward or a backward (a non-finite loss skipped on one rank) is still named, at its next
checked call.

Ranks that made the same calls so far predict the same next call: :class:`CallSequence`
records which checked call followed which and replays it as the prediction of the next.
A call the prediction names is checked on the rank alone, with no collective, so a training
loop's forward, backward and step cost nothing after the first optimizer step. A call that
differs (a save every N steps) is agreed through the store instead
(:meth:`zero_comm.CommWatchdog.diverged`, no collective either): if every rank departs alike
they go on; if a rank went on along the prediction, the one that departed raises and the
other's next wait names it. Only where nothing is recorded (the first optimizer step, a call
beyond the recorded ones) is the signature exchanged, on every rank alike.

Why at engine calls and not inside each collective's payload: a payload signature is read
only after the payloads met, and with gloo a size mismatch aborts before that; a signature
before every collective (``robustness.check_paths``) doubles the collective count. Engine
calls are where ranks' paths split in practice (user code between calls); inside one call
the stage-3 coordinator checks departures from its recorded module order.

The watchdog's checks are armed only after the ranks agreed on the ``robustness`` section
(:func:`zero_full.guards.agreement.agree_on_robustness`), so a check configured on one rank only
is named, never paired with another rank's different collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from typing import Protocol

from zero_comm import CollectiveTimeoutError, CommWatchdog
from zero_full.config.robustness import RobustnessConfig

__all__ = ["CallGuard", "CallSequence", "Prediction"]


class _Counters(Protocol):
    global_steps: int
    micro_steps: int


class Prediction(enum.Enum):
    """What the recorded call sequence says of an engine call."""

    NONE = "none"
    """Nothing recorded at its place: exchange its signature."""
    HOLDS = "holds"
    """It is the call recorded there: nothing to exchange."""
    BROKEN = "broken"
    """Another call is recorded there: agree through the store."""


Key = tuple[str, int, int]
"""An engine call as recorded: its site, the unchecked calls before it, its micro-step within
the optimizer step."""


@dataclasses.dataclass(slots=True)
class CallSequence:
    """Which checked engine call followed which, replayed as the prediction of the next.

    Every rank on the same path records the same calls, so every rank predicts alike. The
    micro-step within the optimizer step is part of a call, so a backward followed by the next
    micro-step's forward and one followed by the step are told apart; a save every few steps
    breaks the prediction twice (the save, the call after it), not the steps between.
    """

    follows: dict[Key, Key] = dataclasses.field(default_factory=dict)
    last: Key | None = None
    step: int | None = None
    first_micro: int = 0

    def predict(self, site: str, quiet: int, step: int, micro: int) -> tuple[Prediction, Key | None]:
        """Record the call; what followed the previous call the last time it ran (if it did)."""
        if step != self.step:
            self.step, self.first_micro = step, micro
        key = (site, quiet, micro - self.first_micro)
        expected = self.follows.get(self.last) if self.last is not None else None
        if self.last is not None:
            self.follows[self.last] = key
        self.last = key
        if expected is None:
            return Prediction.NONE, None
        return (Prediction.HOLDS if expected == key else Prediction.BROKEN), expected


class CallGuard:
    """The engine's call checks: one per engine, over its watchdog and step counters.

    Args:
        watchdog: The engine's watchdog (``None``: nothing is checked).
        counters: The engine's step counters (their values go into each signature).
    """

    __slots__ = ("counters", "quiet", "sequence", "watchdog")

    def __init__(self, watchdog: CommWatchdog | None, counters: _Counters) -> None:
        self.watchdog = watchdog
        self.counters = counters
        self.quiet = 0  # calls since the last check that issued no collective (compared at the next)
        self.sequence = CallSequence()

    def __repr__(self) -> str:
        armed = self.watchdog is not None and self.watchdog.check_calls
        return f"CallGuard(check_calls={armed})"

    def arm(self, robustness: RobustnessConfig) -> None:
        """Turn on the configured checks (after every rank agreed on them)."""
        if self.watchdog is not None:
            self.watchdog.check_calls = robustness.check_calls
            self.watchdog.check_paths = robustness.check_paths

    def check(self, site: str) -> None:
        """Compare engine call ``site`` (``"engine.save_checkpoint"``) across ranks (collective).

        Raises:
            zero_comm.RanksDivergedError: the ranks make different calls (every rank's call
                site, step and position, on every rank), or this rank's call failed earlier.
        """
        if self.watchdog is None:
            return
        prediction = self._predict(self.watchdog, site)
        if prediction is Prediction.NONE:
            c = self.counters
            self.watchdog.check_call(site, c.global_steps, c.micro_steps, quiet=self.quiet)
        self.quiet = 0

    def _predict(self, wd: CommWatchdog, site: str) -> Prediction | None:
        """Check ``site`` against the recorded sequence: nothing to do when it holds, the store
        agreement when it breaks; ``Prediction.NONE``: the caller exchanges the signature.
        ``None``: the check is off (nothing recorded)."""
        wd.refuse_if_broken(f"calls {site}")
        if not wd.check_calls:
            return None
        c = self.counters
        entered = f"calls {site} at optimizer step {c.global_steps}, micro-step {c.micro_steps}"
        wd.entered(entered)
        prediction, expected = self.sequence.predict(site, self.quiet, c.global_steps, c.micro_steps)
        if prediction is Prediction.BROKEN and expected is not None:
            unchecked = f" after {self.quiet} unchecked engine calls" if self.quiet else ""
            wd.diverged(
                f"{entered}{unchecked} where the ranks' recorded calls have {expected[0]}",
                shown=True,
            )
        return prediction

    def refuse(self, site: str) -> None:
        """Raise if this rank's earlier call failed alone (no collective); see :meth:`check`."""
        if self.watchdog is not None:
            self.watchdog.refuse_if_broken(f"calls {site}")

    @contextlib.contextmanager
    def deferred(self, site: str) -> Iterator[None]:
        """Check ``site`` just before its first collective; a call that issues none is counted as quiet.

        For calls whose collectives all issue through zero-comm (the optimizer step): a stage-3
        step without clipping issues none, so the ranks do not line up for it at all. Where the
        recorded sequence holds, nothing is exchanged either way.
        """
        wd = self.watchdog
        if wd is None:
            yield
            return
        prediction = self._predict(wd, site)
        if prediction is None:  # the check is off
            self.quiet = 0
            yield
            return
        if prediction is Prediction.NONE:
            c = self.counters
            wd.defer_call(site, c.global_steps, c.micro_steps, quiet=self.quiet)
        before = wd.calls_issued
        try:
            yield
        finally:
            wd.settle_call()
            self.quiet = self.quiet + 1 if wd.calls_issued == before else 0

    @contextlib.contextmanager
    def call(self, site: str, *, communicates: bool = True) -> Iterator[None]:
        """:meth:`check`, then run the call; if it raises, tell the peers this rank left the path.

        For calls that run user code (forward, backward): an error there may strike one rank
        only, leaving the peers waiting in collectives this rank will never issue.
        ``communicates=False``: the call issues no collective here; it is counted, not checked.
        """
        if communicates:
            self.check(site)
        else:
            self.refuse(site)
            self.quiet += 1
        try:
            yield
        except CollectiveTimeoutError:  # raised on every rank already
            raise
        except BaseException as exc:
            if self.watchdog is not None:
                c = self.counters
                text = str(exc).splitlines()[0][:200] if str(exc) else ""
                self.watchdog.abandon(
                    f"raised {type(exc).__name__} in {site} at optimizer step {c.global_steps}, "
                    f"micro-step {c.micro_steps} ({text})"
                )
            raise
