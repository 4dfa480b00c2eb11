"""A pool of gloo ranks that runs test functions in separate processes.

Starting a process that imports torch costs seconds, so a pool keeps its
ranks alive and runs one test function after another on them. Every rank
has an initialised default process group (gloo, file store under the pool's
work directory) and ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK`` set from the
explicit ``ranks_per_node``, so tests can simulate several nodes on one
machine.

Failure handling is the point of this module:

* an exception on any rank becomes one :class:`RankFailure` naming the rank
  and carrying its traceback;
* a rank that does not answer before the deadline is killed and reported
  as hung (:class:`RankTimeout`), never a hung suite;
* after any failure the pool is torn down; the next run starts a fresh one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from zero_launch import LaunchError, RankFailureKind, RankGroup, send_failure

_GRACE_AFTER_FAILURE_S = 10.0
_STARTUP_TIMEOUT_S = 120.0


class RankFailure(AssertionError):
    """A test function raised on one or more ranks."""


class RankTimeout(AssertionError):
    """One or more ranks did not finish before the deadline and were killed."""


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """What a test function may want to know about the rank it runs on."""

    rank: int
    world_size: int
    ranks_per_node: int
    workdir: str

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node


def _worker_main(rank: int, world_size: int, ranks_per_node: int, workdir: str, conn: Connection) -> None:
    """Process entry of a pool rank (spawned by :class:`zero_launch.RankGroup`).

    Answers ``("ok", None)`` once in the process group, then ``("ok", result)`` or ``("error",
    (summary, traceback, time))`` for each job, until the job ``None``.
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % ranks_per_node))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    info = RankInfo(rank, world_size, ranks_per_node, workdir)
    conn.send(("ok", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            # Exit without destroy_process_group(): tearing gloo down politely costs
            # seconds per pool and the parent only needs the process gone.
            conn.close()
            os._exit(0)
        fn, args, kwargs = job
        try:
            result = fn(info, *args, **kwargs) if _wants_info(fn) else fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
            send_failure(conn, exc)


def _wants_info(fn: Callable[..., Any]) -> bool:
    """A test function receives a :class:`RankInfo` if its first parameter is named ``rank``."""
    import inspect

    params = list(inspect.signature(fn).parameters)
    return bool(params) and params[0] == "rank"


class DistributedPool:
    """``world_size`` live gloo ranks that run functions on request.

    Use :meth:`run`; a pool that failed is closed and must be replaced
    (``PoolRegistry`` does that for tests). The processes are spawned, watched and killed by
    :class:`zero_launch.RankGroup`.
    """

    def __init__(self, world_size: int, ranks_per_node: int, workdir: pathlib.Path) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(
                f"ranks_per_node={ranks_per_node} must be >= 1 and divide world_size={world_size}"
            )
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self._group = RankGroup(
            _worker_main, world_size, workdir=str(workdir), ranks_per_node=ranks_per_node, name="zero"
        )
        self.alive = True
        self._collect("pool start-up", _STARTUP_TIMEOUT_S)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        If ``fn``'s first parameter is named ``rank`` it receives a :class:`RankInfo` first.
        """
        if not self.alive:
            raise RuntimeError("this DistributedPool failed earlier and was closed; create a new one")
        self._group.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        try:
            results = self._group.collect(what, timeout, failure_grace=_GRACE_AFTER_FAILURE_S)
        except LaunchError as exc:
            self.alive = False  # the group killed every rank
            raise self._failure(what, exc, timeout) from None
        return [r.value for r in results]

    def _failure(self, what: str, exc: LaunchError, timeout: float) -> AssertionError:
        topo = f"world_size={self.world_size}, ranks_per_node={self.ranks_per_node}"
        hung = sorted(exc.still_running)
        failed = [f for f in exc.failures if f.kind is not RankFailureKind.TIMED_OUT]
        if failed:
            first = failed[0]  # the launcher's first culprit
            lines = [f"{what} failed on rank(s) {sorted(f.rank for f in failed)} ({topo})."]
            if hung:
                lines.append(f"Rank(s) {hung} did not finish after the failure and were killed.")
            lines.append(f"--- traceback of rank {first.rank} ---\n{first.traceback or first.describe()}")
            lines += [
                f"rank {f.rank}: {f.summary}" for f in sorted(failed, key=lambda f: f.rank) if f is not first
            ]
            return RankFailure("\n".join(lines))
        return RankTimeout(
            f"{what}: rank(s) {hung} did not finish within {timeout:.0f}s ({topo}) and were killed. "
            "A rank probably waits in a collective the others never entered."
        )

    def close(self, kill: bool = False) -> None:
        """Stop every rank (politely unless ``kill``)."""
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for conn, proc in zip(self._group.conns, self._group.procs):
                if proc.is_alive():
                    with contextlib.suppress(BrokenPipeError, OSError):
                        conn.send(None)
        self._group.close(kill=kill)


class PoolRegistry:
    """Keeps at most ``max_pools`` pools alive, keyed by (world size, ranks per node).

    The default, 4, holds the worlds the suites use (1, 2, 4 and 2 nodes x 2 ranks) at once: a
    test parametrized over worlds 1, 2 and 4 then starts each pool once per session rather
    than once per call (with 2, every call of such a sequence evicted a pool and started one:
    seconds of spawning and importing torch per call). Idle ranks only wait on their pipe.
    """

    def __init__(self, root: pathlib.Path, max_pools: int = 4) -> None:
        self.root = root
        self.max_pools = max_pools
        self._pools: dict[tuple[int, int], DistributedPool] = {}
        self._started = 0

    def get(self, world_size: int, ranks_per_node: int | None = None) -> DistributedPool:
        key = (world_size, ranks_per_node or world_size)
        pool = self._pools.get(key)
        if pool is not None and pool.alive:
            self._pools[key] = self._pools.pop(key)  # most recently used last
            return pool
        self._pools.pop(key, None)
        while len(self._pools) >= self.max_pools:
            oldest = next(iter(self._pools))
            self._pools.pop(oldest).close()
        self._started += 1
        workdir = self.root / f"pool{self._started}-w{key[0]}-n{key[1]}"
        pool = DistributedPool(key[0], key[1], workdir)
        self._pools[key] = pool
        return pool

    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        *args: Any,
        ranks_per_node: int | None = None,
        timeout: float = 120.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn`` on ``world_size`` gloo ranks; return per-rank results."""
        return self.get(world_size, ranks_per_node).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
