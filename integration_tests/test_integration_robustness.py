"""Failures under torchrun: a rank that stalls, dies or takes another path is named, not hung on.

Each test runs ``robustness_worker.py`` under ``torch.distributed.run`` at world 2 with
``robustness.comm_timeout = 3`` s and ``heartbeat_interval = 0.4`` s and reads what every
rank reported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_testing.scripts import run_to_end

WORKER = Path(__file__).with_name("robustness_worker.py")
TIMEOUT = 3.0


def _torchrun(
    mode: str, out: Path, ckpt: Path | None = None, *, limit: float = 90, **env_extra: str
) -> dict[int, dict]:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    cmd += [str(WORKER), mode, str(out)] + ([str(ckpt)] if ckpt is not None else [])
    proc = run_to_end(cmd, env={"OMP_NUM_THREADS": "1", **env_extra}, timeout=limit)
    found = {}
    for r in (0, 1):
        path = out / f"rank{r}.json"
        if path.exists():
            found[r] = json.loads(path.read_text())
    found[-1] = {"log": proc.stdout, "returncode": proc.returncode}
    return found


def test_an_extra_submodule_call_on_one_rank_raises_on_both_naming_the_module(tmp_path):
    # the default config (check_paths = false): rank 1 leaves the recorded module order
    res = _torchrun("extra", tmp_path)
    for r in (0, 1):
        assert res[r].get("error") == "RanksDivergedError", res
        message = res[r]["message"]
        assert "rank 1 runs `mid` (forward) where its recorded order has 'out' (forward)" in message, message
        assert message.startswith("rank 0 ") and "(call " in message  # both ranks' positions
        assert "ranks took different paths" in message
        assert res[r]["seconds"] < TIMEOUT + 5


@pytest.mark.parametrize("check_paths", ["0", "1"])
def test_an_extra_call_in_the_first_step_is_caught(tmp_path, check_paths):
    # in the first step no module order is recorded yet: the default config checks every
    # collective's path while a step records (check_paths = true: in every step)
    res = _torchrun("extra0", tmp_path, ZERO_ROBUST_CHECK_PATHS=check_paths)
    for r in (0, 1):
        assert res[r].get("error") == "RanksDivergedError", res
        message = res[r]["message"]
        assert "rank 1 gathers `mid` (call " in message and message.startswith("rank 0 "), message
        assert message.count("(call ") == 2  # both ranks' positions
        assert res[r]["seconds"] < TIMEOUT + 5


def test_an_extra_submodule_call_in_stage_2_trains_on(tmp_path):
    # stage 2 reduces each gradient once per backward whatever ran: the collectives stay paired
    res = _torchrun("extra", tmp_path, ZERO_ROBUST_STAGE="2")
    for r in (0, 1):
        assert "error" not in res[r] and len(res[r]["losses"]) == 4, res


def test_a_rank_on_another_path_is_named_after_comm_timeout(tmp_path):
    """Rank 1 runs one step less and then waits in Python: rank 0's next engine call times out
    naming both ranks' last engine calls and rank 1 as alive but stuck."""
    res = _torchrun("diverge", tmp_path)
    assert res[0].get("error") == "CollectiveTimeoutError", res
    message = res[0]["message"]
    assert "rank 0 calls engine.forward at optimizer step" in message, message
    assert "rank 1 calls engine.step at optimizer step" in message, message
    assert "rank 1 is stuck outside any collective: alive (heartbeats on)" in message
    assert res[0]["seconds"] < TIMEOUT + 5 + 2  # two steps of training before the stuck one
    assert "error" not in res[1]


def test_a_stopped_rank_is_named_as_not_responding(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    proc = subprocess.Popen(cmd + [str(WORKER), "stop", str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        while not (out / "rank0.json").exists() and time.monotonic() - start < 60:
            time.sleep(0.2)
    finally:
        for line in subprocess.run(
            ["pgrep", "-f", f"robustness_worker.py stop {out}"], capture_output=True, text=True
        ).stdout.split():
            os.kill(int(line), signal.SIGKILL) if int(line) != proc.pid else None
        proc.kill()
        proc.communicate()
    report = json.loads((out / "rank0.json").read_text())
    assert report.get("error") == "CollectiveTimeoutError", report
    assert "rank 1 sent no heartbeat for" in report["message"] and "it died or is stuck" in report["message"]
    assert report["seconds"] < TIMEOUT + 5 + 2


def test_different_hidden_sizes_fail_at_initialize_naming_the_parameter(tmp_path):
    res = _torchrun("hidden", tmp_path)
    for r in (0, 1):
        assert res[r].get("error") == "RankMismatchError", res
        assert "parameter 'inp.weight' differs on rank(s) 1" in res[r]["message"]
        assert res[r]["losses"] == []


def test_a_rank_killed_during_save_leaves_a_stale_directory_that_the_restart_removes(tmp_path):
    unbroken = _torchrun("unbroken", tmp_path / "u", tmp_path / "ckpt_u")
    killed = _torchrun("killsave", tmp_path / "k", tmp_path / "ckpt")
    assert killed[-1]["returncode"] != 0
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "global_step2" in names and any(n.startswith("global_step3.tmp-") for n in names), names
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    resumed = _torchrun("resume", tmp_path / "r", tmp_path / "ckpt")
    for r in (0, 1):
        assert "error" not in resumed[r], resumed
        assert resumed[r]["losses"] == unbroken[r]["losses"][2:]  # bit-exact: steps 3 and 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["global_step2", "latest"]
