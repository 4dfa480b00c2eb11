"""Worker scripts launched as a user launches them: ``python`` for one process, ``torchrun`` for more.

``run_script`` runs one to its end and fails naming the script, its arguments and the tail of
its output. A worker that trains several times takes ``OUT1 [options] --then OUT2 [options]``
(``run_chained`` launches them and reads each run's result, ``chain_runs`` writes that command
line, ``split_runs`` reads it, ``run_each`` is the worker's main): several runs in one launch,
so the ranks import torch and the trainer once instead of once per run. ``write_from_rank_0``
writes a run's JSON result once. ``run_to_end`` runs a launch that may fail on purpose (a fault
test's) and returns its exit code and output.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

THEN = "--then"


def torchrun(world: int) -> list[str]:
    """The command that starts a script on ``world`` local ranks (plain ``python`` for one)."""
    if world == 1:
        return [sys.executable]
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), *rdzv]


def run_script(
    script: Path,
    argv: list[str],
    *,
    world: int,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run ``script argv`` on ``world`` ranks in ``cwd``, its folder first on ``PYTHONPATH`` (the
    worker imports its neighbours); raise ``AssertionError`` unless it exits 0."""
    path = os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")])
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run(
        [*torchrun(world), str(script), *argv],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{script.name} {argv} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def run_to_end(
    command: list[str], *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``command`` to its end, whatever its exit code (a launch that fails on purpose), with
    ``env`` over this process's environment; its output is stdout and stderr in one stream. A
    command still running after ``timeout`` s is killed: ``AssertionError`` with its output's tail."""
    proc = subprocess.Popen(
        command,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        raise AssertionError(f"{shlex.join(command)} did not finish in {timeout} s:\n{log[-3000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout=log)


def chain_runs(runs: dict[str, list[str]], out_dir: Path) -> list[str]:
    """The command line of several runs: each writes ``out_dir/<name>.json``, then its options."""
    argv: list[str] = []
    for name, options in runs.items():
        argv += [*([THEN] if argv else []), str(out_dir / f"{name}.json"), *options]
    return argv


def run_chained(
    script: Path, runs: dict[str, list[str]], out_dir: Path, *, world: int, timeout: float = 600
) -> dict[str, Any]:
    """Every run of ``runs`` in one launch of ``script`` (:func:`chain_runs`), in ``out_dir``;
    each run's JSON result by name."""
    run_script(script, chain_runs(runs, out_dir), world=world, cwd=out_dir, timeout=timeout)
    return {name: json.loads((out_dir / f"{name}.json").read_text()) for name in runs}


def split_runs(argv: list[str]) -> list[list[str]]:
    """Each run's own arguments, in order, from ``OUT1 [options] --then OUT2 [options] ...``."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == THEN:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def run_each(train: Callable[[list[str]], None], argv: list[str] | None = None) -> None:
    """A worker's main: ``train`` once per run of the command line (``sys.argv[1:]`` by default)."""
    for run in split_runs(sys.argv[1:] if argv is None else argv):
        train(run)


def write_from_rank_0(path: str | Path, result: object) -> None:
    """``result`` as JSON at ``path``, written by global rank 0 only (``RANK``, 0 without torchrun)."""
    if int(os.environ.get("RANK", "0")) == 0:
        Path(path).write_text(json.dumps(result))
