"""The GPU check's dry run: the same code as ``nox -s gpu`` on CPU with gloo, so that it cannot rot.

Every parity case (stages 0-3, MiCS, CPU offload; worlds 1 and 2) must match the single-process
reference, every implementation of the speed section must run, and the late-rank watchdog case
must complete; the JSON and markdown results name the command.
"""

from __future__ import annotations

import json

import gpu_check


def test_dry_run_matches_the_reference_and_writes_its_results(tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    parity = {(r["case"], r["world"]): r for r in result["parity"]}
    assert set(parity) == {(case, world) for case in gpu_check.PARITY_CASES for world in (1, 2)}
    for key, row in parity.items():
        assert row["ok"] and row["loss_rel"] <= 1e-5 and row["weight_rel"] <= 1e-5, (key, row)
        assert row["streams"] == "NoStreams", (key, row)  # no side streams on CPU
    for world in (1, 2):  # on the CPU the masters stay in place; the report says what offload keeps
        placed = parity[("offload", world)]["placement"]
        assert placed["ok"] and placed["master_devices"] == ["cpu"] and placed["offloaded_device_bytes"] > 0
    speed = {r["impl"]: r for r in result["speed"]}
    assert list(speed) == list(gpu_check.SPEED_IMPLS)
    assert all(r["ok"] and r["step_ms"] > 0 and r["x_ddp"] > 0 for r in speed.values()), speed
    assert result["watchdog"]["ok"] and result["watchdog"]["losses_agree"]
    assert result["environment"]["dry_run"] and "gpu_check" in result["environment"]["command"]
    markdown = (tmp_path / "gpu_check_dry_run.md").read_text()
    assert "| stage3 | 2 | gloo |" in markdown and "## Watchdog with one rank 3 s late" in markdown


def test_the_offload_placement_check_on_a_device():
    """On a device the offload case passes only with pinned host masters and less device memory."""
    good = {"master_devices": ["cpu"], "pinned": True, "offloaded_device_bytes": 16, "held": 5}
    stage2 = {"held": 10}
    assert gpu_check.check_offload_placement({"offload": good, "stage2": stage2}, dry_run=False)["ok"]
    for bad in (
        {**good, "master_devices": ["cpu", "cuda:0"]},  # a master or gradient left on the device
        {**good, "pinned": False},  # pageable: the copies cannot overlap
        {**good, "held": 10},  # no device memory saved
    ):
        assert not gpu_check.check_offload_placement({"offload": bad, "stage2": stage2}, dry_run=False)["ok"]
