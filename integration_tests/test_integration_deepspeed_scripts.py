"""DeepSpeed training scripts run unchanged on zero: only the ``import deepspeed`` line differs.

Each script of ``deepspeed_scripts/`` makes the DeepSpeed calls of a public DeepSpeed
script in its order (DeepSpeedExamples' cifar, HelloDeepSpeed's BERT, DeepSpeed-Chat's
ZeRO-3 fine-tuning); each runs twice under ``torchrun`` at world 2 on gloo, once with
DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``) and once with ``zero_full.deepspeed``:

* losses match per step within the parity yardstick (1e-5 relative, fp32) and the LR
  trajectories are equal;
* zero resumes bit-exactly from its own ``save_checkpoint`` (LR scheduler included) and
  ``load_checkpoint`` returns the client state.

DeepSpeed runs without its shared-memory all-reduce (``zero_testing.peers``): that op serves
only inference, and building it is a C++ compile of about 80 CPU seconds on a fresh machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from zero_testing.scripts import run_script

SCRIPTS = Path(__file__).with_name("deepspeed_scripts")
REL = 1e-5


def _torchrun(impl: str, script: str, args: list[str], out: Path, limit: float = 900) -> dict[int, dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {"DS_IMPL": impl, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_script(SCRIPTS / script, args, world=2, cwd=SCRIPTS, env=env, timeout=limit)
    log = proc.stdout + proc.stderr
    assert "shm_comm_op built" not in log, "DeepSpeed built its inference-only shared-memory op"
    results = {r: json.loads((out / f"{impl}-rank{r}.json").read_text()) for r in (0, 1)}
    results[-1] = {"log": log}
    return results


def _close(a: list[float], b: list[float], rel: float = REL) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=rel) for x, y in zip(a, b))


def _matching_runs(
    script: str, args: list[str], out: Path, steps: int, lrs: bool = True
) -> tuple[dict[int, dict], dict[int, dict]]:
    """``script`` under DeepSpeed, then under zero: the per-rank results of each (key -1: the log).

    On every rank zero's losses (``steps`` of them) match DeepSpeed's within the yardstick and,
    with ``lrs``, so do its learning rates (to 1e-12).
    """
    ds = _torchrun("deepspeed", script, args, out)
    zero = _torchrun("zero", script, args, out)
    for r in (0, 1):
        d, z = ds[r], zero[r]
        assert len(z["losses"]) == steps and _close(z["losses"], d["losses"]), (z["losses"], d["losses"])
        if lrs:
            assert _close(z["lrs"], d["lrs"], 1e-12), (z["lrs"], d["lrs"])
    return ds, zero


def test_cifar_script_with_warmup_lr_matches_deepspeed_and_resumes(tmp_path):
    args = ["--deepspeed_config", "cifar_ds_config.json", "--out", str(tmp_path)]
    ds, zero = _matching_runs("cifar_ds.py", args, tmp_path, steps=24)
    for r in (0, 1):
        d, z = ds[r], zero[r]
        assert z["lrs"][0] < z["lrs"][-1] == 1e-3  # the warm-up
        for key in (
            "global_steps",
            "global_samples",
            "train_batch_size",
            "micro",
            "accumulation",
            "world_size",
        ):
            assert z[key] == d[key], key
        assert z["grad_norm"] > 0  # DeepSpeed 0.19.8 keeps none at stage 0 (None)
        assert d["grad_norm"] is None or math.isclose(z["grad_norm"], d["grad_norm"], rel_tol=1e-4)
        assert z["applied"] and z["skipped"] == 0
        assert z["resumed"] == z["losses"][z["half"] :] and z["resumed_lrs"] == z["lrs"][z["half"] :]
        assert z["client_state"] == {"epoch": 1} and z["resumed_steps"] == 24
    progress = [line for line in zero[-1]["log"].splitlines() if "step=" in line]
    assert progress and progress[0].endswith("loss_scale=1.0") and "step=5, skipped=0, lr=[" in progress[0]


def test_hello_deepspeed_bert_script_matches_deepspeed_and_resumes(tmp_path):
    ds, zero = _matching_runs("bert_ds.py", [str(tmp_path)], tmp_path, steps=21, lrs=False)
    for r in (0, 1):
        d, z = ds[r], zero[r]
        assert z["resumed"] == z["losses"][8:]
        assert z["client_state"] == {"checkpoint_step": 8}  # DeepSpeed's also holds its own entries
        assert d["client_state"]["checkpoint_step"] == 8
        assert z["latest"] == d["latest"] == "global_step21" and z["global_steps"] == 21


def test_deepspeed_chat_zero3_script_matches_deepspeed_and_resumes(tmp_path):
    args = ["--out", str(tmp_path)]
    ds, zero = _matching_runs("sft_zero3_ds.py", args, tmp_path, steps=40)
    for r in (0, 1):
        d, z = ds[r], zero[r]
        assert math.isclose(z["eval_loss"], d["eval_loss"], rel_tol=1e-4)
        assert z["global_steps"] == d["global_steps"] == 20
        assert z["resumed"] == z["losses"][20:] and z["resumed_lrs"] == z["lrs"][20:]
        assert z["client_state"] == {"epoch": 1}
    assert zero[1]["weights"] == {} and set(zero[0]["weights"]) == set(ds[0]["weights"])
    for name, values in zero[0]["weights"].items():  # Adam: parameters compared loosely (the yardstick)
        assert _close(values, ds[0]["weights"][name], 1e-2), name
