"""zero under Lightning Fabric (``ZeroFabricStrategy``), world 2 over gloo on the CPU.

Each run is ``fabric_worker.py`` launched as a user would: ``torchrun --nproc_per_node 2`` for
zero, plain ``python`` (one process, the whole global batch, plain torch) for the reference. The
three stages share one launch (stage 3 saving after step 3); the resumed run starts in processes
of its own.

* ``fabric.setup`` / ``backward`` / ``optimizer.step()`` at stages 1, 2, 3: per-step losses and
  final weights within 1e-5 of plain torch (clipping by the config's ``gradient_clipping``);
  at stage 3 the model built by ``fabric.init_module()`` is partitioned; ``fabric.clip_gradients``
  is refused with a message naming ``gradient_clipping``.
* ``fabric.save`` after step 3 and ``fabric.load`` in a fresh run: steps 4.. and the final
  weights bit for bit equal to the uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zero_testing.scripts import run_chained, run_script

HERE = Path(__file__).parent
RTOL = 1e-5


def _run(out: Path, *args: str, world: int = 2) -> dict:
    run_script(HERE / "fabric_worker.py", [str(out), *args], world=world, cwd=out.parent)
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


@pytest.fixture(scope="module")
def stage_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fabric_stages")


@pytest.fixture(scope="module")
def stage_runs(stage_dir) -> dict[int, dict]:
    """Stages 1, 2 and 3 at world 2, one after the other in one launch; stage 3 saves into
    ``ckpt/`` after step 3 (the resume test's checkpoint)."""
    runs = {str(stage): ["--stage", str(stage)] for stage in (1, 2, 3)}
    runs["3"] += ["--save-at", "3", "--ckpt", str(stage_dir / "ckpt")]
    results = run_chained(HERE / "fabric_worker.py", runs, stage_dir, world=2)
    return {int(stage): result for stage, result in results.items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fabric_matches_single_process(stage, reference, stage_runs):
    got = stage_runs[stage]
    assert got["stage"] == stage
    assert got["partitioned"] == (stage == 3)
    assert "gradient_clipping" in got["clip_refused"]
    _close(reference["losses"], got["losses"])
    assert sorted(got["weights"]) == sorted(reference["weights"])
    _close(_flat(reference["weights"]), _flat(got["weights"]))


def test_fabric_resumes_exactly_at_stage_3(tmp_path, stage_runs, stage_dir):
    whole, ckpt = stage_runs[3], str(stage_dir / "ckpt")
    resumed = _run(tmp_path / "resumed.json", "--stage", "3", "--resume", ckpt)
    assert len(resumed["losses"]) == len(whole["losses"]) - 3
    assert resumed["losses"] == whole["losses"][3:]
    assert resumed["weights"] == whole["weights"]
