"""pid_alive: a running process, a reaped one, another user's (the probe is refused), no pid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zero_launch import pid_alive


def test_a_running_process_is_alive_and_a_reaped_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(os.getpid()) and pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)


def test_a_process_the_probe_may_not_signal_is_alive(monkeypatch: pytest.MonkeyPatch):
    def refused(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refused)
    assert pid_alive(12345)


@pytest.mark.parametrize("pid", [0, -1, -4242, True, 3.0, "12"])
def test_what_is_not_a_process_id_is_refused_by_name(pid):
    with pytest.raises(ValueError, match=f"pid_alive: {pid!r} is not a process id"):
        pid_alive(pid)
