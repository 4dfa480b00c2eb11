"""``csv_monitor`` files as DeepSpeed 0.19.8 writes them: the same script and config under DeepSpeed
(CPU) and under ``zero_full.deepspeed`` at world 2 give the same directory, file names, headers,
steps (samples seen) and learning rates; zero writes more events (loss, memory, bytes sent)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_testing.peers import deepspeed_for_training

ACCUM, MICRO, STEPS = 2, 2, 4


def _config(out: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "steps_per_print": 1 << 30,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 3},
        },
        "zero_optimization": {"stage": 1},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "job"},
    }


def _run(impl: str, out: str) -> None:
    if impl == "deepspeed":
        deepspeed = deepspeed_for_training()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zero_full.deepspeed as deepspeed
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(out))
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS * ACCUM):
        loss = engine(torch.randn(MICRO, 5, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if impl == "deepspeed":
        engine.destroy()
    else:
        engine.zero_engine.close()


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_monitor_layout_matches_deepspeed(dist, tmp_path):
    ds_out, zero_out = tmp_path / "ds", tmp_path / "zero"
    dist.run(2, _run, "deepspeed", str(ds_out), timeout=600)
    dist.run(2, _run, "zero", str(zero_out), timeout=600)
    ds_files = sorted(p.name for p in (ds_out / "job").iterdir())
    zero_files = sorted(p.name for p in (zero_out / "job").iterdir())
    assert ds_files == ["Train_Samples_lr.csv"]  # DeepSpeed's engine writes the lr (and fp16's scale)
    assert set(ds_files) < set(zero_files) and "Train_Samples_train_loss.csv" in zero_files
    ds_rows, zero_rows = _rows(ds_out / "job" / ds_files[0]), _rows(zero_out / "job" / ds_files[0])
    assert ds_rows[0] == zero_rows[0] == ["step", "lr"]
    assert [r[0] for r in zero_rows[1:]] == [r[0] for r in ds_rows[1:]]  # samples seen, one row per step
    assert len(ds_rows) == STEPS + 1
    ds_lrs = [float(r[1]) for r in ds_rows[1:]]
    assert [float(r[1]) for r in zero_rows[1:]] == pytest.approx(ds_lrs, rel=1e-12)
