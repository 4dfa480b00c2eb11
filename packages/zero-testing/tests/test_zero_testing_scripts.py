"""zero_testing.scripts: the ``--then`` command line round trip, a worker running each run, a
failing script named, and a command run to its end whatever its exit, or killed at its timeout."""

from __future__ import annotations

import sys

import pytest

from zero_testing.scripts import (
    chain_runs,
    run_chained,
    run_script,
    run_to_end,
    split_runs,
    torchrun,
    write_from_rank_0,
)

WORKER = """
import sys
from zero_testing.scripts import run_each, write_from_rank_0

def train(argv):
    out, *options = argv
    if options == ["--fail"]:
        print("failing on purpose", file=sys.stderr)
        sys.exit(3)
    write_from_rank_0(out, options)

run_each(train)
"""


def test_chained_runs_split_back_into_each_runs_arguments(tmp_path):
    runs = {"a": ["--stage", "1"], "b": [], "c": ["--x", "--then-not"]}
    argv = chain_runs(runs, tmp_path)
    assert argv.count("--then") == 2
    assert split_runs(argv) == [[str(tmp_path / f"{name}.json"), *options] for name, options in runs.items()]


def test_one_launch_runs_every_chained_run(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    runs = {"first": ["--lr", "1"], "second": []}
    assert run_chained(script, runs, tmp_path, world=1) == runs  # each run wrote its own options


def test_a_failing_script_is_named_with_its_exit_code_and_output(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with pytest.raises(AssertionError, match=r"worker.py .* exited 3:[\s\S]*failing on purpose"):
        run_script(script, [str(tmp_path / "out.json"), "--fail"], world=1, cwd=tmp_path)


def test_a_command_that_fails_on_purpose_returns_its_exit_code_and_output():
    script = "import os, sys; print('out', os.environ['ZT_X'], flush=True); sys.exit('err')"
    done = run_to_end([sys.executable, "-c", script], env={"ZT_X": "7"})
    assert done.returncode == 1 and done.stdout == "out 7\nerr\n"


def test_a_command_past_its_timeout_is_killed_and_named_with_its_output():
    script = "import time; print('started', flush=True); time.sleep(60)"
    with pytest.raises(AssertionError, match=r"-c .* did not finish in 3 s:\nstarted"):
        run_to_end([sys.executable, "-c", script], timeout=3)


def test_more_than_one_rank_goes_through_torchrun():
    assert torchrun(1) == [sys.executable]
    command = torchrun(4)
    assert (
        command[1:3] == ["-m", "torch.distributed.run"]
        and command[command.index("--nproc_per_node") + 1] == "4"
    )


def test_only_global_rank_0_writes_the_result(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    write_from_rank_0(tmp_path / "r1.json", [1])
    monkeypatch.setenv("RANK", "0")
    write_from_rank_0(tmp_path / "r0.json", [0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0.json"]
