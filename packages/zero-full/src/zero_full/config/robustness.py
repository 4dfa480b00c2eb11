"""``robustness``: watchdog, non-finite gradient policy and rank agreement (not a DeepSpeed section)."""

from __future__ import annotations

import enum
from typing import Annotated

from zero_full.config.base import Section
from zero_full.config.types import USED, Choice, Flag, Real

__all__ = ["NonFinitePolicy", "RobustnessConfig"]


class NonFinitePolicy(str, enum.Enum):
    """What an fp32 / bf16 step does when some rank's gradients hold an inf or nan."""

    SKIP = "skip"
    RAISE = "raise"


class RobustnessConfig(Section):
    """``robustness``: what zero checks so that failures are named instead of hanging or corrupting.

    Not a DeepSpeed section. See the "When things go wrong" page of the docs for every failure
    these keys govern and what zero says about it.
    """

    _PATH = ("robustness",)

    comm_timeout: Annotated[Real(0, lo_open=True), USED] = 300.0
    """Seconds a rank waits for one collective of the engine (forward, backward, step; each exchange of a
    checkpoint save / load, which then raises ``zero_full.CheckpointError``) before every live
    rank raises ``zero_comm.CollectiveTimeoutError`` saying which rank is where (which operation,
    call number, module or parameter), or which rank stopped sending heartbeats. Default 300 s:
    well under the process group's own 30 minutes, well above any healthy collective. Raise it for
    very slow links or very large first gathers."""
    heartbeat_interval: Annotated[Real(0, lo_open=True), USED] = 2.0
    """Seconds between two heartbeats (and position reports) each rank's watchdog thread writes to
    the process group's store; a rank silent for ``5 * heartbeat_interval`` seconds while the
    others wait is reported as dead or stuck."""
    watchdog: Annotated[Flag, USED] = True
    """Run the collective watchdog (``false``: collectives block until the process group's own
    timeout, with torch's message)."""
    nonfinite_gradients: Annotated[Choice(NonFinitePolicy), USED] = NonFinitePolicy.SKIP
    """fp32 / bf16: what a step does when some rank's gradients hold an inf or nan (found by the
    gradient-clipping norm, or by one all-reduce of a flag without clipping). ``skip`` (default):
    the step is skipped on every rank (the optimizer state does not move), with one warning naming
    the first non-finite parameter and the rank holding it; ``raise``: every rank raises
    ``zero_full.NonFiniteGradientError`` naming it. fp16 keeps its loss-scaler rule (skip and
    lower the scale)."""
    check_calls: Annotated[Flag, USED] = True
    """Start every engine call that communicates (forward, backward, step, checkpoint save /
    load, ``consolidated_state_dict``, ``save_pretrained``, ...) with one all-gather of a 64-byte
    signature (call, optimizer step, micro-step, calls since the last check) and raise
    ``zero_comm.RanksDivergedError`` on every rank when they differ, naming each rank's call
    site: a call made on some ranks only (``if rank == 0: engine.consolidated_state_dict()``),
    a rank with one batch less. A rank whose forward or backward raised stops issuing
    collectives and its peers raise naming it. Calls that issue no collective (below stage 3: a
    forward, a backward before the accumulation boundary) are counted into the next signature,
    not checked: a skipped backward is named at the next checked call. Needs the watchdog. On
    by default (cost: see the benchmarks page); ``false`` turns off the signature exchange only."""
    check_paths: Annotated[Flag, USED] = False
    """Before every collective of every step, all-gather a small signature (operation, call
    number, what it is for) and raise ``zero_comm.RanksDivergedError`` on every rank at the first
    difference, naming each rank's position. Off by default: it adds one small collective per
    collective. Without it, engine calls are still compared (``check_calls``), stage 3 checks
    this way while a step records its module order (the first step), and afterwards catches a
    rank that leaves the recorded order before its gather (through the store, no collective).
    Turn it on for collectives that differ inside one engine call (your own code between
    modules); with gloo mismatched sizes otherwise abort the process in C++ ("Received data size
    doesn't match expected size"), before any timeout could fire."""
    check_rank_agreement: Annotated[Flag, USED] = True
    """At ``initialize``, compare every rank's parameter names, shapes, dtypes, ``requires_grad``
    flags and effective config values (one all-gather of digests) and raise on every rank naming
    the first difference, instead of aborting in the communication library later."""
