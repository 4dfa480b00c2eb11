"""The demo runs clean, and its comparison really flags mismatches."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from zero_comm.demo import compare, main


def test_demo_passes_at_world_two():
    proc = subprocess.run(
        [sys.executable, "-m", "zero_comm.demo", "--world", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: world 2" in proc.stdout and "reduce_scatter" in proc.stdout


def test_compare_flags_wrong_values_shapes_and_tolerance():
    a = torch.arange(5.0)
    assert compare("x", [a], [a.clone()]) == []
    assert compare("x", [a + 1e-3], [a], rel=1e-2) == []
    assert compare("x", [a + 1], [a]) == ["x[0]: values differ from the torch reference"]
    assert "beyond rel" in compare("x", [a + 1], [a], rel=1e-2)[0]
    assert "expected torch.float32(4,)" in compare("x", [a], [a[:4]])[0]
    assert compare("x", [a], [a, a]) == ["x: 1 results, expected 2"]


def test_demo_rejects_a_ranks_per_node_that_does_not_divide_world(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--world", "3", "--ranks-per-node", "2"])
    assert exc.value.code == 2
    assert "--ranks-per-node 2 must be >= 1 and divide --world 3" in capsys.readouterr().err
