"""What the benchmarks measure with: byte and memory counters, timers, spawned ranks.

Physical bytes written by a process come from :func:`read_wchar`; :func:`time_and_count` times a
collective on every rank (the slowest rank per run) and counts the bytes it wrote;
:func:`timed_across_ranks` times one training step. Ranks are launched by :func:`spawn_ranks`
through ``zero_launch`` (a rank that fails is named at once, the others killed).
"""

from __future__ import annotations

import re
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from zero_launch import RankContext, launch

__all__ = [
    "ResultSink",
    "StepTiming",
    "median_seconds",
    "peak_rss_bytes",
    "read_wchar",
    "reset_peak_rss",
    "rss_bytes",
    "spawn_ranks",
    "thread_minor_faults",
    "time_and_count",
    "timed_across_ranks",
]


def read_wchar() -> int:
    """Bytes this process has written so far (``wchar`` of ``/proc/self/io``: sockets and files).

    Read it before and after a window with no printing inside: the delta is what the process
    sent, e.g. the bytes of its collectives over gloo's TCP sockets.
    """
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line (Linux only)")


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")
    return int(match.group(1))


def rss_bytes() -> int:
    """Resident set size of this process now (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or :func:`reset_peak_rss` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (writes ``5`` to ``/proc/self/clear_refs``).

    Returns ``False`` when the kernel refuses (then :func:`peak_rss_bytes` is the process's peak).
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_and_count(fn: Callable[[], object], repeats: int) -> tuple[list[float], list[int]]:
    """Run ``fn()`` ``repeats`` times on every rank, each run after a barrier (the group is up).

    Returns per run the slowest rank's seconds (the same list on every rank) and the bytes this
    rank wrote (``wchar``, see :func:`read_wchar`).
    """
    import torch
    import torch.distributed as dist

    times, wrote = [], []
    for _ in range(repeats):
        dist.barrier()
        w0, t0 = read_wchar(), time.perf_counter()
        fn()
        t1, w1 = time.perf_counter(), read_wchar()
        times.append(t1 - t0)
        wrote.append(w1 - w0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist(), wrote


class StepTiming(NamedTuple):
    """One step timed by :func:`timed_across_ranks`."""

    wall_s: float
    """The slowest rank's wall seconds."""
    thread_cpu_s: float
    """This rank's training-thread CPU seconds (gloo's own threads are not counted)."""
    minor_faults: int
    """Minor page faults of this rank's training thread: pages touched for the first time since
    the allocator got them from the kernel (each one zeroed by the kernel), ``getrusage``'s
    ``ru_minflt`` for the thread."""


def thread_minor_faults() -> int:
    """Minor page faults of the calling thread so far (``getrusage(RUSAGE_THREAD).ru_minflt``)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def timed_across_ranks(step: Callable[[], object]) -> StepTiming:
    """Run ``step()`` on every rank after a barrier and time it (:class:`StepTiming`)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    faults = thread_minor_faults()
    start, cpu = time.perf_counter(), time.thread_time()
    step()
    cpu = time.thread_time() - cpu
    faults = thread_minor_faults() - faults
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return StepTiming(float(took), cpu, faults)


class ResultSink:
    """What a benchmark rank puts its result on (``results.put(x)``); :func:`spawn_ranks` returns it."""

    __slots__ = ("filled", "value")

    def __init__(self) -> None:
        self.filled = False
        self.value: Any = None

    def put(self, value: Any) -> None:
        self.filled, self.value = True, value


def _benchmark_rank(ctx: RankContext, target: Callable[..., None], args: Any) -> tuple[bool, Any]:
    sink = ResultSink()
    target(ctx.rank, args, ctx.store_path, sink)
    return sink.filled, sink.value


def spawn_ranks(
    target: Callable[..., None], world: int, args: Any, timeout: float, process_group: bool = False
) -> Any:
    """Run ``target(rank, args, store_path, results)`` on ``world`` spawned processes.

    The ranks rendezvous through a file store in a temporary directory (they join the gloo
    process group themselves, or with ``process_group`` have joined it before ``target`` runs,
    with ``timeout`` as its limit); one of them calls ``results.put(result)``, and that result
    is returned.
    Launched by :func:`zero_launch.launch`: a rank that raises or dies is an error naming
    it (its exception, exit code or signal) at once, the others killed; so is a rank still
    running after ``timeout``.
    """
    answers = launch(
        _benchmark_rank,
        world,
        target,
        args,
        timeout=timeout,
        process_group=process_group,
        name="benchmark",
    )
    for answer in answers:
        filled, value = answer.value
        if filled:
            return value
    raise RuntimeError(f"none of the {world} benchmark ranks put a result")
