"""Local gloo ranks: spawn them, watch them, collect their results, kill them.

:func:`launch` runs a module-level function on ``world`` spawned processes (``multiprocessing``
spawn, one thread each) that meet through a file store in a temporary directory and returns
each rank's value as a :class:`RankAnswer`, in rank order. A rank that raises, dies (exit code
or signal) or is still running at the deadline is named at once in a :class:`LaunchError`
(with its traceback when it raised) and every other rank is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = [
    "LaunchError",
    "RankContext",
    "RankFailure",
    "RankFailureKind",
    "RankGroup",
    "RankAnswer",
    "launch",
    "send_failure",
]

_FAILURE_GRACE_S = 2.0  # after a failure, how long the other ranks may take to report theirs


class RankFailureKind(enum.Enum):
    """How a rank failed."""

    RAISED = "raised"  # the function raised; the traceback is known
    EXITED = "exited"  # the process ended without an answer (exit code)
    SIGNALED = "signaled"  # the process was killed by a signal
    TIMED_OUT = "timed out"  # still running at the deadline (then killed)


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """One rank's failure."""

    rank: int
    kind: RankFailureKind
    summary: str
    traceback: str = ""
    exit_code: int | None = None
    when: float = dataclasses.field(default_factory=time.time)

    def describe(self) -> str:
        """``"rank 1 raised ValueError: boom"``, ``"rank 2 exited (code 3)"``, ..."""
        return f"rank {self.rank} {self.summary}"


@dataclasses.dataclass(frozen=True)
class RankAnswer:
    """What one rank returned.

    Attributes:
        rank: The rank.
        value: The function's return value.
        seconds: Time from the launch until the rank answered.
    """

    rank: int
    value: Any
    seconds: float


class LaunchError(RuntimeError):
    """One or more ranks failed; the others were killed."""

    def __init__(
        self,
        what: str,
        failures: Sequence[RankFailure],
        still_running: Sequence[int],
        results: Mapping[int, RankAnswer],
    ) -> None:
        self.failures = tuple(failures)
        self.still_running = tuple(still_running)
        self.results = dict(results)
        first = self.failures[0]
        lines = [f"{what}: {first.describe()}"]
        timed_out = RankFailureKind.TIMED_OUT
        lines += [f"  then {f.describe()}" for f in self.failures[1:] if f.kind is not timed_out]
        killed = [r for r in self.still_running if r != first.rank]
        if killed:
            lines.append(f"  rank(s) {killed} were still running and have been killed")
        if first.traceback:
            lines.append(f"--- traceback of rank {first.rank} ---\n{first.traceback.rstrip()}")
        super().__init__("\n".join(lines))

    @property
    def rank(self) -> int:
        """The first culprit."""
        return self.failures[0].rank

    @property
    def traceback(self) -> str:
        """The first culprit's traceback (``""`` when it died without one)."""
        return self.failures[0].traceback


class RankContext:
    """What the launched function receives first: its rank, the world and a way to report progress."""

    __slots__ = ("_conn", "ranks_per_node", "rank", "store_path", "workdir", "world_size")

    def __init__(
        self, rank: int, world_size: int, ranks_per_node: int, workdir: str, conn: Connection
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.workdir = workdir
        self.store_path = os.path.join(workdir, "store")
        self._conn = conn

    @property
    def init_method(self) -> str:
        """The file store every rank of the launch meets on (``file://...``)."""
        return f"file://{self.store_path}"

    def send(self, payload: Any) -> None:
        """Report ``payload`` to the parent (its ``on_message(rank, payload)``) while running."""
        self._conn.send(("msg", payload))


def _exit_failure(rank: int, code: int | None) -> RankFailure:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return RankFailure(rank, RankFailureKind.SIGNALED, f"was killed by {name} ({-code})", exit_code=code)
    return RankFailure(rank, RankFailureKind.EXITED, f"exited (code {code})", exit_code=code)


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while the ranks start (they inherit it before importing torch)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RankGroup:
    """``world`` spawned processes with a duplex pipe each; the parent's side of the protocol.

    ``entry(rank, world, ranks_per_node, workdir, conn, *args)`` runs in each process; it answers
    with ``("ok", value)`` or ``("error", (summary, traceback, time.time()))`` (:func:`send_failure`)
    and may send ``("msg", payload)``
    first. The processes inherit ``OMP_NUM_THREADS=1``, ``LOCAL_WORLD_SIZE`` and ``env``.
    """

    def __init__(
        self,
        entry: Callable[..., None],
        world: int,
        args: Sequence[Any] = (),
        *,
        workdir: str,
        ranks_per_node: int | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "zero",
    ) -> None:
        rpn = ranks_per_node or world
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if rpn < 1 or world % rpn:
            raise ValueError(f"ranks_per_node={rpn} must be >= 1 and divide world={world}")
        self.world = world
        self.ranks_per_node = rpn
        self.workdir = workdir
        self.started = time.monotonic()
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        wanted = {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(rpn), **(env or {})}
        with _environment(wanted):
            for rank in range(world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=entry,
                    args=(rank, world, rpn, workdir, child, *args),
                    name=f"{name}-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)

    def send(self, message: Any) -> None:
        """Send ``message`` to every rank."""
        for conn in self.conns:
            conn.send(message)

    def collect(
        self,
        what: str,
        timeout: float,
        *,
        quiet: bool = False,
        on_message: Callable[[int, Any], None] | None = None,
        failure_grace: float = _FAILURE_GRACE_S,
    ) -> tuple[RankAnswer, ...]:
        """Wait for every rank's answer; return them in rank order."""
        results: dict[int, RankAnswer] = {}
        failures: list[RankFailure] = []
        pending = dict(enumerate(self.conns))
        start = time.monotonic()
        limit = start + timeout
        give_up: float | None = None
        while pending:
            now = time.monotonic()
            end = limit if give_up is None else min(limit, give_up)
            if now >= end:
                break
            for conn in wait(list(pending.values()), timeout=end - now):
                rank = next(r for r, c in pending.items() if c is conn)
                outcome = self._receive(rank, conn, on_message, start)
                if quiet:
                    limit = time.monotonic() + timeout
                if outcome is None:
                    continue
                del pending[rank]
                if isinstance(outcome, RankAnswer):
                    results[rank] = outcome
                else:
                    failures.append(outcome)
                    give_up = give_up or time.monotonic() + failure_grace
        if not failures and not pending:
            return tuple(results[r] for r in range(self.world))
        self.close(kill=True)
        running = sorted(pending)
        if not failures:
            how = "sent nothing for" if quiet else "still running after"
            failures = [RankFailure(r, RankFailureKind.TIMED_OUT, f"{how} {timeout:g} s") for r in running]
        failures.sort(key=_culprit_order)
        raise LaunchError(what, failures, running, results)

    def _receive(
        self, rank: int, conn: Connection, on_message: Callable[[int, Any], None] | None, start: float
    ) -> RankAnswer | RankFailure | None:
        """One message from ``rank``: its answer, its failure, or ``None`` for a progress report."""
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the process is gone without an answer
            self.procs[rank].join(1.0)
            return _exit_failure(rank, self.procs[rank].exitcode)
        if kind == "ok":
            return RankAnswer(rank, payload, time.monotonic() - start)
        if kind == "error":
            summary, text, when = payload
            return RankFailure(rank, RankFailureKind.RAISED, f"raised {summary}", text, when=when)
        if on_message is not None:
            on_message(rank, payload)
        return None

    def close(self, kill: bool = False, grace: float = 5.0) -> None:
        """Wait up to ``grace`` seconds for the processes to exit (none with ``kill``), then kill them."""
        for proc in self.procs:
            proc.join(0 if kill else grace)
            if proc.is_alive():
                proc.kill()
                proc.join(10.0)
        for conn in self.conns:
            conn.close()


def _culprit_order(failure: RankFailure) -> tuple[int, float]:
    """Died first, then raised (earliest first), then timed out."""
    rank = {RankFailureKind.EXITED: 0, RankFailureKind.SIGNALED: 0, RankFailureKind.RAISED: 1}
    return rank.get(failure.kind, 2), failure.when


def send_failure(conn: Connection, exc: BaseException) -> None:
    """Report ``exc`` (being handled) to the parent as ``("error", (summary, traceback, time))``."""
    with contextlib.suppress(OSError):
        conn.send(("error", (f"{type(exc).__name__}: {exc}", traceback.format_exc(), time.time())))


def _launched_main(
    rank: int,
    world: int,
    ranks_per_node: int,
    workdir: str,
    conn: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    process_group: bool,
    pg_timeout: float,
) -> None:
    """Process entry of :func:`launch`: environment, process group, ``fn``, the answer."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % ranks_per_node),
        MASTER_ADDR="127.0.0.1",
    )
    ctx = RankContext(rank, world, ranks_per_node, workdir, conn)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if process_group:
            dist.init_process_group(
                "gloo",
                init_method=ctx.init_method,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
        try:
            value = fn(ctx, *args)
        except BaseException as exc:  # reported before leaving the group: the peers fail after
            send_failure(conn, exc)
            return
        finally:
            if process_group and dist.is_initialized():
                dist.destroy_process_group()
        conn.send(("ok", value))
    except BaseException as exc:  # every failure goes back to the parent
        send_failure(conn, exc)
    finally:
        conn.close()


def launch(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float,
    ranks_per_node: int | None = None,
    process_group: bool = True,
    pg_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    on_message: Callable[[int, Any], None] | None = None,
    quiet: bool = False,
    name: str = "zero",
) -> tuple[RankAnswer, ...]:
    """Run ``fn(ctx, *args)`` on ``world`` spawned local ranks; return their results in rank order.

    ``fn`` is a module-level function; ``ctx`` is the rank's :class:`RankContext`. With
    ``process_group`` (the default) each rank has joined a gloo default process group on the
    launch's file store before ``fn`` runs, and leaves it after.
    """
    with tempfile.TemporaryDirectory(prefix=f"{name}-launch-") as tmp:
        group = RankGroup(
            _launched_main,
            world,
            (fn, args, process_group, pg_timeout or timeout),
            workdir=tmp,
            ranks_per_node=ranks_per_node,
            env=env,
            name=name,
        )
        try:
            results = group.collect(f"{name} failed", timeout, quiet=quiet, on_message=on_message)
        finally:
            group.close()
    return results
