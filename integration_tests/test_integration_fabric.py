"""zero under Lightning Fabric (``ZeroFabricStrategy``), world 2 over gloo on the CPU.

Each run is ``fabric_worker.py`` launched as a user would: ``torchrun --nproc_per_node 2`` for
zero, plain ``python`` (one process, the whole global batch, plain torch) for the reference.

* ``fabric.setup`` / ``backward`` / ``optimizer.step()`` at stages 1, 2, 3: per-step losses and
  final weights within 1e-5 of plain torch (clipping by the config's ``gradient_clipping``);
  at stage 3 the model built by ``fabric.init_module()`` is partitioned; ``fabric.clip_gradients``
  is refused with a message naming ``gradient_clipping``.
* ``fabric.save`` after step 3 and ``fabric.load`` in a fresh run: steps 4.. and the final
  weights bit for bit equal to the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RTOL = 1e-5


def _run(out: Path, *args: str, world: int = 2) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    launch = [sys.executable]
    if world > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(world)]
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    proc = subprocess.run(
        [*launch, str(HERE / "fabric_worker.py"), str(out), *args],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"fabric_worker.py {args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(out.read_text())


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= RTOL * max(abs(x), abs(y), 1e-3), f"element {i}: {x} vs {y}"


def _flat(weights: dict) -> list[float]:
    out: list[float] = []

    def walk(v):
        if isinstance(v, list):
            for e in v:
                walk(e)
        else:
            out.append(v)

    for key in sorted(weights):
        walk(weights[key])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("fabric_ref") / "out.json", world=1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fabric_matches_single_process(stage, reference, tmp_path):
    got = _run(tmp_path / "out.json", "--stage", str(stage))
    assert got["stage"] == stage
    assert got["partitioned"] == (stage == 3)
    assert "gradient_clipping" in got["clip_refused"]
    _close(reference["losses"], got["losses"])
    assert sorted(got["weights"]) == sorted(reference["weights"])
    _close(_flat(reference["weights"]), _flat(got["weights"]))


def test_fabric_resumes_exactly_at_stage_3(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = _run(tmp_path / "whole.json", "--stage", "3", "--save-at", "3", "--ckpt", ckpt)
    resumed = _run(tmp_path / "resumed.json", "--stage", "3", "--resume", ckpt)
    assert len(resumed["losses"]) == len(whole["losses"]) - 3
    assert resumed["losses"] == whole["losses"][3:]
    assert resumed["weights"] == whole["weights"]
