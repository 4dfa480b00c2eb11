"""A collective watchdog with a diagnosis: no hang without saying which rank is where.

A :class:`CommWatchdog` lives as long as the engine that created it. It

* **records** what this rank is doing: every zero-comm collective it issues (operation and
  call number) with what it is for (:func:`note_collectives`: e.g. "gathers `mid`", set by the layers
  above), and since when;
* **publishes** that position with a heartbeat counter from a daemon thread, every
  ``heartbeat_interval`` seconds, under ``zero/watchdog/<namespace><rank>`` in a
  ``torch.distributed`` store that every rank reaches (the process group's store);
* **waits** for collectives by polling their completion (a timed wait on NCCL aborts the
  communicator when it expires; the engine-call check on gloo blocks in timed waits, which
  gloo survives) and every ``heartbeat_interval`` reads the other ranks' positions. It raises
  :class:`CollectiveTimeoutError` — on every live rank, never an abort — when a peer's
  heartbeat stopped for ``5 * heartbeat_interval`` seconds ("rank 1 sent no heartbeat for
  12 s: it died or is stuck"), when the wait exceeds ``timeout`` ("rank 1 gathers `mid`
  (call 41) while rank 0 reduce-scatters the gradients of `out` (call 40): ranks took
  different paths"), or when the communication library reports a failure (a peer that died
  is named as a rank, not as a socket);
* **checks engine calls** (:meth:`CommWatchdog.check_call`, :mod:`zero_comm.call_sites`) and
  stops a rank whose engine call failed alone (:meth:`CommWatchdog.abandon`), peers naming it;
* **checks departures**: a rank about to leave the module order the others follow (the stage-3
  coordinator knows it from its recorded trace, before it gathers) compares notes with the
  other ranks through the store (:meth:`CommWatchdog.diverged`, no collective) and, when it
  departs alone, raises :class:`RanksDivergedError` on every rank at once.

The watchdog is active while a :class:`~zero_comm.CommLedger` that carries it is active
(``CommLedger(topology, watchdog=wd)``); every zero-comm collective issued then runs
asynchronously under it (:mod:`zero_comm.watched`: a synchronous call waits through the
watchdog before returning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zero_comm.call_sites import CallExchange
from zero_comm.closing import ClosesOnExit
from zero_comm.completion import wait_polled, wait_timed
from zero_comm.devices import control_device, default_store
from zero_comm.torch_compat import all_gather_single
from zero_comm.wait_timings import WaitTimings

__all__ = ["CollectiveTimeoutError", "CommWatchdog", "RankPosition", "RanksDivergedError", "render_label"]

_KEY = "zero/watchdog/{}{}"  # namespace, rank

_VERBS = {
    "all_gather": "gathers",
    "reduce_scatter": "reduce-scatters",
    "all_reduce": "all-reduces",
    "broadcast": "broadcasts",
    "all_to_all": "exchanges (all-to-all)",
    "idle": "is outside any collective",
}


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: raised on every live rank, naming which rank is where."""


class RanksDivergedError(CollectiveTimeoutError):
    """Ranks took different paths: raised on every rank, naming each one's position.

    Found when a rank leaves its recorded module order alone (:meth:`CommWatchdog.diverged`, at
    stage 3 by default) or, with ``check_paths``, at the first differing collective.
    """


@dataclasses.dataclass(frozen=True, slots=True)
class RankPosition:
    """What one rank was doing, as published in the store.

    Attributes:
        rank: Global rank.
        op: Collective kind (``"idle"`` outside any collective).
        call: Number of collectives this rank issued so far (this one included).
        what: What it is for (``"gathers `mid`"``; empty when nothing was noted).
        since: Wall-clock time the rank entered it.
        beat: Heartbeat counter (grows every ``heartbeat_interval`` while the rank lives).
        waiting: Whether the rank is blocked in a wait.
        diverged: ``(call, index, digest)`` of the rank's last few departures from its recorded
            module order or call sequence (:meth:`CommWatchdog.diverged`), oldest first; ``index``
            counts the departures at the same call number (an engine call and then a module).
        broken: Set when the rank raised :class:`RanksDivergedError` at such a departure, or
            left the path with an error (:meth:`CommWatchdog.abandon`): where it stopped
            (``"rank 1 runs `mid` (forward) ..."``); peers waiting for it raise too.
        closed: The rank closed its watchdog (its engine): it issues no more collectives.
        entered: The engine call the rank is in (``"calls engine.forward at optimizer step 3,
            micro-step 6"``; empty outside an engine).
    """

    rank: int
    op: str
    call: int
    what: str
    since: float
    beat: int = 0
    waiting: bool = False
    diverged: tuple[tuple[int, int, int], ...] = ()
    broken: str = ""
    closed: bool = False
    entered: str = ""

    def describe(self) -> str:
        """``rank 1 gathers `mid` (call 41)``."""
        return f"rank {self.rank} {self._doing()}"

    def describe_call(self) -> str:
        """:meth:`describe` with the engine call the rank is in, when it said
        (``rank 1 calls engine.forward at optimizer step 3, micro-step 6 and gathers `mid` (call 41)``)."""
        if self.entered and self.entered != self.what:
            return f"rank {self.rank} {self.entered} and {self._doing()}"
        return self.describe()

    def _doing(self) -> str:
        return f"{self.what or _VERBS.get(self.op, self.op)} (call {self.call})"


class CommWatchdog(ClosesOnExit):
    """Records this rank's collectives, heartbeats them to a store, diagnoses stuck waits.

    Args:
        store: A ``torch.distributed.Store`` every rank reaches (``None``: the default
            process group's store; no cross-rank diagnosis if there is none).
        rank: This process's global rank.
        world_size: Number of ranks.
        timeout: Seconds one collective may take before every rank raises.
        heartbeat_interval: Seconds between heartbeats; a rank silent for 5 intervals while
            others wait for it is reported as dead or stuck.
        check_paths: Before every collective, all-gather a fixed-size signature (operation,
            call number, digest of what it is for) and raise :class:`RanksDivergedError` on
            every rank of the group at the first difference. Costs one small collective per
            collective; it catches diverged paths before a size mismatch aborts the process
            inside the communication library (gloo's "Received data size doesn't match").
        check_calls: Make :meth:`check_call` compare engine calls across ranks (one small
            all-gather per engine call; ``False``: :meth:`check_call` does nothing).
        namespace: Keeps the records of watchdogs alive at once on one store apart (each
            engine's: ``"engine2/"``); every rank passes the same. Without it, a peer could
            read another watchdog's record as this one's.

    Attributes:
        timings: Set to a :class:`~zero_comm.WaitTimings` to record when each collective was
            issued and how long its wait took (``None``, the default: nothing is recorded).

    Use :meth:`close` (or ``with``) to stop the heartbeat thread.
    """

    __slots__ = (
        "__weakref__",
        "_beat",
        "_broken",
        "_call",
        "_closed",
        "_deferred",
        "_departures",
        "_entered",
        "_exchanges",
        "_key",
        "_label",
        "_position",
        "_recording",
        "_seen",
        "_stopper",
        "_store_lock",
        "_thread",
        "check_calls",
        "check_paths",
        "heartbeat_interval",
        "rank",
        "store",
        "timeout",
        "timings",
        "world_size",
    )

    def __init__(
        self,
        store: Any | None,
        rank: int,
        world_size: int,
        *,
        timeout: float = 300.0,
        heartbeat_interval: float = 2.0,
        check_paths: bool = False,
        check_calls: bool = False,
        namespace: str = "",
    ) -> None:
        if not timeout > 0 or not heartbeat_interval > 0:
            raise ValueError(
                f"CommWatchdog: timeout ({timeout}) and heartbeat_interval ({heartbeat_interval}) must be > 0"
            )
        self.store = store if store is not None else default_store()
        self._key = _KEY.format(namespace, "{}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.heartbeat_interval = float(heartbeat_interval)
        self.check_paths = check_paths
        self.check_calls = check_calls
        self._closed = False
        self.timings: WaitTimings | None = None
        self._recording = False
        self._call = 0
        self._beat = 0
        self._label = ""
        self._departures: tuple[tuple[int, int, int], ...] = ()
        self._entered = ""  # the engine call this rank is in (named when a peer breaks off)
        self._exchanges: dict[Any, CallExchange] = {}  # check_call's, per process group
        self._deferred: tuple[str, int, int, int] | None = None  # defer_call's, until a collective
        self._broken = ""
        self._position = ("idle", 0, "", time.time(), False)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last beat, my monotonic time it changed)
        self._store_lock = threading.Lock()
        self.publish()
        self._thread: threading.Thread | None = None
        self._stopper: weakref.finalize | None = None
        if self.store is not None and world_size > 1:
            stop = threading.Event()
            self._thread = threading.Thread(
                target=_heartbeat_loop, args=(weakref.ref(self), stop, heartbeat_interval), daemon=True
            )
            self._thread.name = f"zero-watchdog-rank{rank}"
            self._thread.start()
            # Stopped by close(), when the watchdog is collected, or at the latest at interpreter
            # exit, before daemon threads are frozen (see _stop_heartbeat).
            self._stopper = weakref.finalize(self, _stop_heartbeat, stop, self._thread)

    def __repr__(self) -> str:
        return f"CommWatchdog(rank={self.rank}, world_size={self.world_size}, timeout={self.timeout:g})"

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which a rank is reported as dead or stuck."""
        return 5 * self.heartbeat_interval

    def close(self) -> None:
        """Stop the heartbeat thread (idempotent); the last record says closed (a peer waiting raises)."""
        if not self._closed and self.store is not None and self.world_size > 1:
            self._closed = True
            with contextlib.suppress(Exception):  # the store is gone (interpreter exit): nothing to tell
                self.publish()
        if self._stopper is not None:
            self._stopper()
        self._thread = None

    # ------------------------------------------------------------------ recording

    def note(self, what: str | Callable[[], str]) -> None:
        """Say what the next collectives are for (``"gathers `mid`"``; a callable is rendered only
        when published or diagnosed); ``""`` clears it."""
        self._label = what

    def issued(self, op: str) -> int:
        """Record one issued collective; returns its call number."""
        self._call += 1
        self._position = (op, self._call, self._label, time.time(), False)
        return self._call

    @property
    def calls_issued(self) -> int:
        """Collectives this rank issued so far (the number of the last one)."""
        return self._call

    @property
    def position_label(self) -> str | Callable[[], str]:
        """What the current collectives are for (the last :meth:`note`), unrendered."""
        return self._label

    def position(self) -> RankPosition:
        """This rank's current position."""
        op, call, what, since, waiting = self._position
        return RankPosition(
            self.rank, op, call, render_label(what), since, self._beat, waiting, entered=self._entered
        )

    def publish(self) -> None:
        """Write this rank's position and the next heartbeat to the store (the thread, every interval)."""
        if self.store is None:
            return
        # Read the state and write it under one lock: a record the heartbeat thread built before
        # the main thread changed the state must not land after the main thread's own publish
        # (a departed rank's last word, ``broken``, would be overwritten by a stale beat).
        with self._store_lock:
            self._beat += 1
            op, call, what, since, waiting = self._position
            record = {
                "op": op,
                "call": call,
                "what": render_label(what),
                "since": since,
                "beat": self._beat,
                "waiting": waiting,
                "diverged": self._departures,
                "broken": self._broken,
                "closed": self._closed,
                "entered": self._entered,
            }
            self.store.set(self._key.format(self.rank), json.dumps(record))

    # ------------------------------------------------------------------ waiting

    def wait(self, work: Any, what: str = "", *, timed: bool = False) -> None:
        """Wait for a ``torch.distributed`` work object; raise a diagnosis instead of hanging.

        Polls the work's completion (:func:`~zero_comm.completion.wait_polled`): a timed wait on
        NCCL aborts the communicator when it expires; ``timed`` (gloo's works only) blocks in
        timed waits instead (:func:`~zero_comm.completion.wait_timed`). Every ``heartbeat_interval``
        it reads the other ranks' positions.

        Raises:
            CollectiveTimeoutError: the wait exceeded ``timeout``, a peer stopped sending
                heartbeats, or the communication failed (message: every rank's position).
        """
        if work is None:
            return
        timings, started = self.timings, time.perf_counter()
        op, call, label, since, _ = self._position
        self._position = (op, call, label, since, True)
        try:
            every = min(self.heartbeat_interval, self.timeout)
            (wait_timed if timed else wait_polled)(work, every, self._check_waiting)
        except CollectiveTimeoutError:
            raise
        except RuntimeError as exc:  # a peer that left the path and exited closes its connections
            self._raise_if_broken(self.peers(), exc)
            raise CollectiveTimeoutError(self._failure(exc)) from exc
        finally:
            op, call, label, since, _ = self._position
            self._position = (op, call, label, since, False)
        if timings is not None:
            timings.waited(work, started)

    def _check_waiting(self, waited: float) -> None:
        """Between polls of a wait: raise when a peer broke off, went silent, or ``timeout`` passed."""
        peers = self.peers()
        self._raise_if_broken(peers)
        self._raise_if_closed(peers)
        silent = self._silent_peers(peers)
        if silent:
            raise CollectiveTimeoutError(self._dead_message(silent))
        if waited >= self.timeout:
            raise CollectiveTimeoutError(self._timeout_message(waited))

    @property
    def paths_checked(self) -> bool:
        """Whether the next collective is preceded by :meth:`check_same_path`.

        Always with ``check_paths``; otherwise while a step records its module order (see
        :meth:`recording`), the one stretch a departure cannot be told from the recorded trace.
        """
        return self.check_paths or self._recording

    def recording(self, on: bool) -> None:
        """Check every collective's path while ``on``: a stage-3 step that records its module order.

        After the recording, a rank that leaves the order is caught before its gather (see
        :meth:`diverged`); during it, nothing is recorded to compare with, so each collective is
        checked as with ``check_paths`` — only for that step.
        """
        self._recording = on

    def check_same_path(self, op: str, call: int, group: Any) -> None:
        """All-gather ``(op, call, digest of what)`` over ``group``; raise on every rank if they differ.

        Raises:
            RanksDivergedError: names every rank's position.
        """
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        if len(ranks) == 1:
            return
        what = render_label(self._position[2])
        device = control_device(group)
        row = [_OPS.index(op) if op in _OPS else -1, call, _digest(what)]
        sig = torch.tensor(row, dtype=torch.int64, device=device)
        out = torch.empty(len(ranks) * 3, dtype=torch.int64, device=device)
        self.wait(all_gather_single(out, sig, group=group, async_op=True))
        rows = out.cpu().view(len(ranks), 3)
        if bool((rows == rows[0]).all()):
            return
        self.publish()  # every rank of the group sees the mismatch now: publish, then read the others
        calls = {r: int(rows[i, 1]) for i, r in enumerate(ranks)}
        deadline = time.monotonic() + 2 * self.heartbeat_interval + 1.0
        while True:
            positions = {r: p for r, p in self.peers().items() if p is not None}
            fresh = all(
                positions.get(r) is not None and positions[r].call == c
                for r, c in calls.items()
                if r != self.rank
            )
            if fresh or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        positions[self.rank] = self.position()
        lines = []
        for i, r in enumerate(ranks):
            pos = positions.get(r)
            if pos is not None and pos.call == int(rows[i, 1]) and r == self.rank:
                lines.append(pos.describe())
            else:
                op_name = _OPS[int(rows[i, 0])] if 0 <= int(rows[i, 0]) < len(_OPS) else "?"
                lines.append(_describe_remote(r, op_name, int(rows[i, 1]), pos))
        raise RanksDivergedError(
            f"{' while '.join(lines)}: ranks took different paths (a module or collective called on some "
            "ranks only, or a different number of times). Make every rank run the same forward / backward"
        )

    def check_call(self, site: str, step: int, micro: int, group: Any = None, *, quiet: int = 0) -> None:
        """Start engine call ``site`` (e.g. ``"engine.step"``) at ``step`` / ``micro``: all-gather its
        signature over ``group`` (:mod:`zero_comm.call_sites`; with ``check_calls`` off, no collective).
        ``quiet``: the engine calls since the last check that issued no collective (compared too).

        Raises:
            RanksDivergedError: the ranks' calls, steps or micro-steps differ (every rank's call
                site, on every rank), or this rank left the path earlier (:meth:`abandon`).
        """
        self.refuse_if_broken(f"calls {site}")
        if not self.check_calls:
            return
        exchange = self._exchanges.get(group)
        if exchange is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
            if len(ranks) == 1:
                return
            exchange = self._exchanges[group] = CallExchange(group, ranks)
        with torch.profiler.record_function("zero.watchdog.check_call"):
            label, self._label = self._label, f"enters {site}"
            call = self.issued("all_gather")
            try:
                self.wait(exchange.start(site, step, micro, call - 1, quiet), timed=exchange.timed)
            except BaseException:
                exchange.renew()
                raise
            finally:
                self._label = label
        text = exchange.mismatch()
        if text:
            raise RanksDivergedError(text)

    def entered(self, call: str) -> None:
        """Say which engine call this rank is in (``"calls engine.forward at optimizer step 3,
        micro-step 6"``): named in this rank's own line when a peer broke off; no collective."""
        self._entered = call

    def defer_call(self, site: str, step: int, micro: int, *, quiet: int = 0) -> None:
        """:meth:`check_call` on the default group, postponed to this rank's next collective.

        A call that issues none (a stage-3 optimizer step without clipping) then costs no
        exchange and keeps the ranks from lining up for nothing; :meth:`settle_call` ends it.
        Only for calls whose collectives all issue through :func:`zero_comm.watched.watched_call`.
        """
        self.refuse_if_broken(f"calls {site}")
        if self.check_calls and self.world_size > 1:
            self._deferred = (site, step, micro, quiet)
            # the peers read the call entered, not the label of this rank's last collective
            op, call, _, since, waiting = self._position
            self._position = (op, call, f"enters {site}", since, waiting)

    def check_deferred(self) -> None:
        """Run the deferred call check now (a collective is about to issue), if one is pending."""
        if self._deferred is not None:
            (site, step, micro, quiet), self._deferred = self._deferred, None
            self.check_call(site, step, micro, quiet=quiet)

    def settle_call(self) -> bool:
        """End a deferred call; ``True`` when it issued no collective, so was never checked."""
        pending, self._deferred = self._deferred, None
        return pending is not None

    @property
    def broken(self) -> str:
        """Where this rank left the others' path (``""``: it did not); see :meth:`abandon`."""
        return self._broken

    def abandon(self, what: str) -> None:
        """This rank left the path with an error (``what``: ``"raised ValueError in engine.backward ..."``).

        Peers waiting in a collective raise :class:`RanksDivergedError` naming it within one
        heartbeat interval; this rank's next collective or :meth:`check_call` raises instead of
        issuing a collective the peers would pair with one of another size.
        """
        if self._broken:
            return
        self._broken = f"rank {self.rank} {what}"
        if self.store is not None and self.world_size > 1:
            with contextlib.suppress(Exception):  # the store is gone: the peers see the heartbeat stop
                self.publish()

    def refuse_if_broken(self, doing: str) -> None:
        """Raise :class:`RanksDivergedError` if this rank left the path (``doing``: ``"calls x"``)."""
        if not self._broken:
            return
        others = [p.describe() for p in self.peers().values() if p is not None]
        meanwhile = f"; meanwhile {', '.join(others)}" if others else ""
        raise RanksDivergedError(
            f"rank {self.rank} {doing} after it left the other ranks' path ({self._broken}){meanwhile}. "
            "The job cannot continue once one rank's engine call failed on that rank alone: stop "
            "every rank and restart from the last checkpoint"
        )

    def diverged(self, what: str, *, shown: bool = False) -> None:
        """This rank left its recorded path: go on only if every rank leaves it alike.

        Called (through :func:`path_diverged`) by the stage-3 coordinator when a module runs
        where its complete trace expected another one, *before* the rank issues the gather of
        that module — a gather whose size differs from the peers' would abort the process in
        gloo. No collective: the rank publishes ``(call, digest of what)`` in the store and
        reads the others' records until each either departed alike (a data-dependent branch
        taken by every rank: go on) or shows that it went on along the old order (it issued
        more collectives than this rank, or stopped at another departure).

        The engine's call check calls it too, when an engine call is not the one its recorded
        call sequence predicts (see ``zero_full.guards.calls``).

        Args:
            what: Where this rank is, e.g. ``"runs `mid` (forward) where its recorded order has
                `out` (forward)"``; ranks that depart alike pass the same text.
            shown: Publish ``what`` as this rank's position, so peers name it by it.

        Raises:
            RanksDivergedError: another rank went on along another path (every rank's position;
                the peers waiting for this rank raise the same within one heartbeat interval).
            CollectiveTimeoutError: a peer sent no heartbeat for :attr:`dead_after` seconds, or
                none decided within ``timeout``.
        """
        if self.store is None or self.world_size == 1:
            return
        with torch.profiler.record_function("zero.watchdog.diverged"):
            call = self._call
            index = sum(1 for c, _, _ in self._departures if c == call)
            mark = (call, index, _digest(what))
            self._departures = (*self._departures[-7:], mark)
            if shown:
                op, _, _, since, waiting = self._position
                self._position = (op, call, what, since, waiting)
            self.publish()
            pending = set(range(self.world_size)) - {self.rank}
            differ: dict[int, RankPosition] = {}
            start = time.monotonic()
            pause = 0.001
            while pending and not differ:
                for r in sorted(pending):
                    pos = self._read(r)
                    if pos is None:
                        continue
                    if mark in pos.diverged:
                        pending.discard(r)
                    elif pos.broken or pos.closed or pos.call > call or _departed_elsewhere(pos, mark):
                        differ[r] = pos
                if differ or not pending:
                    break
                silent = self._silent_peers()
                if silent:
                    raise CollectiveTimeoutError(self._dead_message(silent))
                if time.monotonic() - start >= self.timeout:
                    waited = time.monotonic() - start
                    raise CollectiveTimeoutError(self._timeout_message(waited, before_next=True))
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            if not differ:
                return
            mine = f"rank {self.rank} {what} (before call {call + 1})"
            self._broken = mine
            self.publish()
            lines = {self.rank: mine} | {r: (p.broken or p.describe_call()) for r, p in differ.items()}
            raise RanksDivergedError(_diverged_text(lines))

    def _raise_if_broken(
        self, peers: dict[int, RankPosition | None], cause: BaseException | None = None
    ) -> None:
        """Raise :class:`RanksDivergedError` when a peer stopped at a departure from its module order."""
        broken = [p for p in peers.values() if p is not None and p.broken]
        if broken:
            lines = {self.rank: self.position().describe_call()} | {p.rank: p.broken for p in broken}
            raise RanksDivergedError(_diverged_text(lines)) from cause

    def _raise_if_closed(self, peers: dict[int, RankPosition | None]) -> None:
        """Raise :class:`RanksDivergedError` when a peer closed before issuing the collective awaited."""
        gone = [p for p in peers.values() if p is not None and p.closed and p.call < self._call]
        if gone:
            closed = {
                p.rank: f"rank {p.rank} closed its engine after call {p.call} (ran fewer steps)" for p in gone
            }
            lines = {self.rank: self.position().describe()} | closed
            raise RanksDivergedError(_diverged_text(lines))

    def peers(self) -> dict[int, RankPosition | None]:
        """Every other rank's last published position (``None``: never published)."""
        found: dict[int, RankPosition | None] = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            found[r] = self._read(r)
        return found

    def _read(self, r: int) -> RankPosition | None:
        key = self._key.format(r)
        try:
            if self.store is None:
                return None
            with self._store_lock:  # one store client, two threads (a FileStore is not thread-safe)
                if not self.store.check([key]):
                    return None
                d = json.loads(self.store.get(key))
        except (RuntimeError, ValueError, OSError):
            return None
        diverged = tuple((int(c), int(i), int(h)) for c, i, h in d.get("diverged", ()))
        broken = d.get("broken", "")
        head = (d["op"], d["call"], d["what"], d["since"], d["beat"], d["waiting"])
        return RankPosition(
            r, *head, diverged, broken, bool(d.get("closed", False)), str(d.get("entered", ""))
        )

    def _silent_peers(
        self, peers: dict[int, RankPosition | None] | None = None
    ) -> list[tuple[int, float, RankPosition | None]]:
        """Peers whose heartbeat did not change for :attr:`dead_after` seconds (my clock).

        A peer that never published (still importing, building its model: slower to start, not
        dead) is reported only after ``timeout``.
        """
        now = time.monotonic()
        silent = []
        for r, pos in (self.peers() if peers is None else peers).items():
            beat = pos.beat if pos is not None else -1
            last = self._seen.get(r)
            if last is None or last[0] != beat:
                self._seen[r] = (beat, now)
            elif now - last[1] >= (self.dead_after if pos is not None else self.timeout):
                silent.append((r, now - last[1], pos))
        return silent

    # ------------------------------------------------------------------ messages

    def _dead_message(self, silent: list[tuple[int, float, RankPosition | None]]) -> str:
        me = self.position()
        parts = []
        for r, quiet, pos in silent:
            if pos is None:
                parts.append(
                    f"rank {r} sent no heartbeat in {quiet:.0f} s: it never reached zero (not in "
                    "initialize: it died early, or took another path before it)"
                )
                continue
            parts.append(
                f"rank {r} sent no heartbeat for {quiet:.0f} s: it died or is stuck; "
                f"it was at: {pos.describe()}"
            )
        return (
            "; ".join(parts)
            + f". This rank ({me.describe()}) waited for it. Check that process (killed, stopped, "
            "out of memory, blocked in I/O); the job cannot continue: restart it from the last checkpoint"
        )

    def _timeout_message(self, waited: float, *, before_next: bool = False) -> str:
        """Why a wait timed out, from every rank's position; ``before_next``: this rank waits
        before its next collective (an agreement through the store), not in its last one."""
        me = self.position()
        peers = self.peers()
        others = [p for p in peers.values() if p is not None]
        absent = [r for r, p in peers.items() if p is None]
        lines = [p.describe_call() for p in others]
        mine = me.call + int(before_next)
        diverged = [p for p in others if (p.op, p.call, p.what) != (me.op, me.call, me.what)]
        stuck = [p for p in diverged if not p.waiting and not p.closed and p.call < mine]
        if absent:
            verdict = (
                f"rank(s) {absent} never reached zero (it died early, is still starting, or took "
                "another path before initialize)"
            )
        elif stuck and len(stuck) == len(diverged):
            verdict = "; ".join(
                f"rank {p.rank} is stuck outside any collective: alive (heartbeats on) but it issued "
                f"no collective for {max(time.time() - p.since, 0.0):.0f} s (blocked in Python code, "
                "I/O or a long computation between two collectives)"
                for p in stuck
            )
        elif diverged:
            verdict = (
                "ranks took different paths (a module or collective called on some ranks only, or a "
                "different number of times)"
            )
        else:
            verdict = "every rank is in the same collective: the communication itself is stuck or very slow"
        head = f"{me.describe_call()} while " + ", ".join(lines) if lines else me.describe_call()
        return (
            f"collective did not complete within {waited:.0f} s "
            f"(robustness.comm_timeout = {self.timeout:g}): "
            f"{head}: {verdict}. Make every rank run the same forward / backward (same modules, same "
            "number of calls), or raise robustness.comm_timeout for a slow link"
        )

    def _failure(self, exc: BaseException) -> str:
        # a peer that died shows as a reset / closed connection: wait briefly for the heartbeats to tell
        deadline = time.monotonic() + self.dead_after + self.heartbeat_interval
        silent = self._silent_peers()
        while not silent and time.monotonic() < deadline:
            time.sleep(min(self.heartbeat_interval, 0.5))
            silent = self._silent_peers()
        if silent:
            return self._dead_message(silent) + f" (communication error: {exc})"
        me = self.position()
        return (
            f"{me.describe()} failed: {exc}. Every peer still sends heartbeats; see the other ranks' errors"
        )


_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=7).digest(), "little")


def _departed_elsewhere(pos: RankPosition, mark: tuple[int, int, int]) -> bool:
    """Whether ``pos`` left the path at or after ``mark``'s place, other than ``mark`` says.

    A peer whose departures all come before ``mark`` (by call number, then index) has not got
    there yet.
    """
    place, digest = mark[:2], mark[2]
    return any((c, i) > place or ((c, i) == place and d != digest) for c, i, d in pos.diverged)


def _diverged_text(lines: dict[int, str]) -> str:
    """``rank 0 ... while rank 1 ...: ranks took different paths ...`` (ranks in order)."""
    return (
        " while ".join(lines[r] for r in sorted(lines))
        + ": ranks took different paths (a module or collective called on some ranks only, or a "
        "different number of times). Make every rank run the same forward / backward"
    )


def _describe_remote(rank: int, op: str, call: int, pos: RankPosition | None) -> str:
    """A peer's position from its signature row, with its published label when it matches."""
    if pos is not None and pos.call == call and pos.what:
        return RankPosition(rank, op, call, pos.what, pos.since).describe()
    return RankPosition(rank, op, call, "", 0.0).describe()


def render_label(what: str | Callable[[], str]) -> str:
    """A collective's label as text (a callable label is called; one that raises gives ``""``)."""
    if callable(what):
        try:
            return str(what())
        except Exception:  # noqa: BLE001 - a label must never break a wait
            return ""
    return what


# How long stopping waits for the heartbeat thread to finish the store write it may be in.
_STOP_JOIN_S = 30.0


def _stop_heartbeat(stop: threading.Event, thread: threading.Thread) -> None:
    """Stop a heartbeat thread and wait until it left the store.

    A daemon thread still inside a store call when the interpreter finalizes is ended by the
    runtime in the middle of C++ code, which aborts the process ("terminate called without an
    active exception"); so a watchdog never closed is stopped at exit, and closing waits for the
    thread's last write instead of a fixed fraction of the interval.
    """
    stop.set()
    if thread is not threading.current_thread():  # collected on the heartbeat thread itself
        thread.join(timeout=_STOP_JOIN_S)


def _heartbeat_loop(ref: weakref.ref[CommWatchdog], stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        wd = ref()
        if wd is None:
            return
        try:
            wd.publish()
        except Exception:  # noqa: BLE001 - the store is gone (shutdown): stop beating
            return
        del wd
