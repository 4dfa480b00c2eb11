"""Shared plumbing of the benchmark scripts: environment metadata, byte counters, result files.

Every script under ``benchmarks/`` writes ``<name>.json`` (everything measured, plus
:func:`environment`) and usually ``<name>.md`` (a table) into its ``--out`` directory through
:func:`write_results`; tables are built with :func:`markdown_table`. Physical bytes written
by a process come from :func:`read_wchar`; :func:`time_and_count` times a collective on every
rank (the slowest rank per run) and counts the bytes it wrote. Ranks are launched by
:func:`spawn_ranks` through ``zero_comm.launch`` (the only zero package imported here: every
benchmark needs zero-comm's torch). A script's command line starts from
:func:`benchmark_parser`; a table that goes into a docs page goes between its markers with
:func:`replace_section`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from zero_comm.launch import RankContext, launch

__all__ = [
    "THREAD_VARIABLES",
    "benchmark_parser",
    "command_env",
    "command_line",
    "environment",
    "markdown_table",
    "median_seconds",
    "peak_rss_bytes",
    "read_wchar",
    "replace_section",
    "ResultSink",
    "reset_peak_rss",
    "rss_bytes",
    "spawn_ranks",
    "time_and_count",
    "versions",
    "write_results",
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


def versions(*dists: str) -> dict[str, str | None]:
    """Installed version of each distribution (``None`` when it is not installed)."""
    found: dict[str, str | None] = {}
    for dist in dists:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def environment(*dists: str) -> dict[str, Any]:
    """Date (UTC), python, machine, core count, 1-minute load and the versions of ``torch`` + ``dists``."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "versions": versions("torch", *dists),
    }


THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
"""Environment variables that set how many threads each rank's operators use."""


def command_env() -> str:
    """The settings in the environment that shape a timing, as a command prefix ("" if none).

    * glibc's allocator (``MALLOC_*``): how often freed memory goes back to the kernel, and so
      how many page faults a step pays;
    * operator threads (:data:`THREAD_VARIABLES`): with two ranks on two cores, torch's
      default of one thread per core puts two threads of each rank on the same cores
      (``nox -s bench`` sets ``OMP_NUM_THREADS=1``).

    A result measured with them names them, so its command reproduces it.
    """
    return "".join(
        f"{k}={v} " for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k in THREAD_VARIABLES
    )


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """How to run ``benchmarks/<script>`` again as this process was run: :func:`command_env` first.

    Args:
        script: The file name under ``benchmarks/`` (printed as ``python benchmarks/<script>``
            wherever the process was started from).
        argv: The arguments (``None``: ``sys.argv[1:]``).
    """
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"{command_env()}python benchmarks/{script}", *args])


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A GitHub markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default: ``l``).

    Cells are written with ``str``; format numbers before passing them.
    """
    headers = list(headers)
    if align and len(align) != len(headers):
        raise ValueError(f"align {align!r} needs one letter per column ({len(headers)} columns)")
    marks = ["---:" if (align[i] if align else "l") == "r" else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks) + "|"]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"row {cells!r} has {len(cells)} cells, the table has {len(headers)} columns")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def benchmark_parser(doc: str, **ints: int | None) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first line, an ``--<name>`` integer option per keyword
    (``new_tokens=64`` is ``--new-tokens``, default 64) and ``--out`` (default ``benchmarks/results``).

    Add the script's other options to what it returns.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in ints.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    return parser


def replace_section(page: pathlib.Path, begin: str, end: str, body: str) -> None:
    """Put ``body`` into ``page`` between the markers ``begin`` and ``end`` (both kept).

    Raises ``RuntimeError`` naming the page and the markers when it does not hold them in order.
    """
    content = page.read_text()
    start, stop = content.find(begin), content.find(end)
    if start < 0 or stop < start:
        raise RuntimeError(f"{page} has no {begin} ... {end} section to hold the table")
    page.write_text(content[: start + len(begin)] + body + content[stop:])


def write_results(
    out: str | os.PathLike[str],
    name: str,
    result: dict[str, Any],
    markdown: str | None = None,
    echo: bool = False,
) -> list[pathlib.Path]:
    """Write ``out/name.json`` (``result``, indented) and, if given, ``out/name.md``; return the paths.

    ``echo``: print ``wrote <path>`` for each, then the markdown.
    """
    directory = pathlib.Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.json"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    if markdown is not None:
        paths.append(directory / f"{name}.md")
        paths[1].write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    if echo:
        print("\n".join([*(f"wrote {p}" for p in paths), *([markdown] if markdown is not None else [])]))
    return paths


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
    Launched by :func:`zero_comm.launch.launch`: a rank that raises or dies is an error naming
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
