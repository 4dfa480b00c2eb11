"""DeepSpeed's monitoring sections: what the engine writes after each optimizer step, on rank 0 only.

* ``csv_monitor`` files and ``tensorboard`` event files (read back with tensorboard's
  ``EventAccumulator``) hold, per optimizer step, the mean of the step's losses and the learning
  rate the engine had, at DeepSpeed's step axis (samples seen), at world 1 and 2, through
  ``zero_full.initialize`` and ``zero_full.deepspeed.initialize``; only rank 0 writes.
* ``wandb``: ``wandb.init`` / ``wandb.log`` of a test double module get the same numbers;
  ``comet``: ``comet_ml.start`` / ``log_metric`` of a double, each event again only
  ``samples_log_interval`` samples after it was last logged (DeepSpeed's rule).
* A section whose package is missing: one WARNING naming the package; the run goes on.
* ``comms_logger``: the table counts every collective the engine's ledger counted.
* ``flops_profiler``: the forward FLOPs of the profiled step equal ``2 * batch * in * out`` per
  Linear.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_full
import zero_full.deepspeed as deepspeed
from zero_full.config.prepare import validate_deepspeed
from zero_full.monitor import build_writers
from zero_full.monitor.writers import Event

MICRO, ACCUM, STEPS = 2, 2, 3


def _config(out: str, **sections: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": 2},
        **sections,
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("zero: step="):
            self.records.append(record)


def _train(rank, config: dict, api: str) -> dict:
    """``STEPS`` optimizer steps; per step the mean of rank 0's losses, the lr and the grad norm."""
    if api == "deepspeed":
        engine, *_ = deepspeed.initialize(model=_model(), config=config)
    else:
        engine = zero_full.initialize(_model(), config)
    records = _Records()
    logging.getLogger("zero.monitor").addHandler(records)
    logging.getLogger("zero.monitor").setLevel(logging.INFO)
    gen = torch.Generator().manual_seed(10 + rank.rank)
    losses, lrs, norms, comm_calls = [], [], [], 0
    for _ in range(STEPS):
        step_losses = []
        for _ in range(ACCUM):
            x = torch.randn(MICRO, 5, generator=gen)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        zero = engine.zero_engine if api == "deepspeed" else engine
        losses.append(sum(step_losses) / ACCUM)
        lrs.append(zero.optimizer.param_groups[0]["lr"])
        norms.append(zero.grad_norm)
        comm_calls += zero.stats.comm.calls
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        (engine.zero_engine if api == "deepspeed" else engine).close()
    logging.getLogger("zero.monitor").removeHandler(records)
    logging.getLogger("zero.monitor").setLevel(logging.NOTSET)
    return {
        "losses": losses,
        "lrs": lrs,
        "norms": norms,
        "comm_calls": comm_calls,
        "printed": printed.getvalue(),
        "progress": [r.getMessage() for r in records.records],
    }


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def _read_tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("world,api", [(1, "zero"), (2, "zero"), (2, "deepspeed")])
def test_csv_and_tensorboard_hold_the_engines_loss_and_lr_per_step(dist, tmp_path, world, api):
    out = str(tmp_path)
    config = _config(
        out,
        csv_monitor={"enabled": True, "output_path": out, "job_name": "csvjob"},
        tensorboard={"enabled": True, "output_path": out, "job_name": "tbjob"},
    )
    results = dist.run(world, _train, config, api)
    first = results[0]
    samples = [MICRO * ACCUM * world * (i + 1) for i in range(STEPS)]

    header, rows = _read_csv(tmp_path / "csvjob" / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == samples  # rank 0 only: one row per step, not one per rank
    assert [v for _, v in rows] == pytest.approx(first["losses"], rel=1e-6)
    assert first["losses"] != results[-1]["losses"] or world == 1  # the ranks saw different data
    header, rows = _read_csv(tmp_path / "csvjob" / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and [v for _, v in rows] == pytest.approx(first["lrs"], rel=1e-12)
    _, rows = _read_csv(tmp_path / "csvjob" / "Train_Samples_grad_norm.csv")
    assert [v for _, v in rows] == pytest.approx(first["norms"], rel=1e-6)
    _, rows = _read_csv(tmp_path / "csvjob" / "Train_Samples_comm_bytes_sent.csv")
    assert all(v > 0 for _, v in rows) if world == 2 else all(v == 0 for _, v in rows)
    _, rows = _read_csv(tmp_path / "csvjob" / "Train_Samples_rss_bytes.csv")
    assert all(v > 50 * 2**20 for _, v in rows)
    assert not (tmp_path / "csvjob" / "Train_Samples_loss_scale.csv").exists()  # fp16 only, as DeepSpeed

    assert len(list((tmp_path / "tbjob").glob("events.out.tfevents.*"))) == 1  # one writer: rank 0
    scalars = _read_tensorboard(tmp_path / "tbjob")
    loss, lr = scalars["Train/Samples/train_loss"], scalars["Train/Samples/lr"]
    assert [s for s, _ in loss] == samples and [s for s, _ in lr] == samples
    assert [v for _, v in loss] == pytest.approx(first["losses"], rel=1e-6)  # float32 events
    assert [v for _, v in lr] == pytest.approx(first["lrs"], rel=1e-6)
    assert {"Train/Samples/step_time_ms", "Train/Samples/peak_rss_bytes"} <= set(scalars)


def _opener(calls: dict, key: str, handle: type):
    """A double of a tracker's ``init`` / ``start``: records its keyword arguments in ``calls[key]``
    and returns a new ``handle``."""

    def open_run(**kwargs):
        calls[key].append(kwargs)
        return handle()

    return open_run


def _fake_wandb(fake: types.ModuleType, calls: dict) -> None:
    calls.update(init=[], log=[], finish=0)

    class Run:
        def finish(self) -> None:
            calls["finish"] += 1

    fake.init = _opener(calls, "init", Run)
    fake.log = lambda data, step=None: calls["log"].append((step, dict(data)))


def _fake_comet(fake: types.ModuleType, calls: dict) -> None:
    calls.update(start=[], name=[], metrics=[], end=0)

    class Experiment:
        def set_name(self, name: str) -> None:
            calls["name"].append(name)

        def log_metric(self, name: str, value: float, step: int | None = None) -> None:
            calls["metrics"].append((name, step, value))

        def end(self) -> None:
            calls["end"] += 1

    fake.start = _opener(calls, "start", Experiment)


def _train_beside_double(rank, config: dict, api: str, package: str, build) -> dict:
    """``_train`` with a test double installed as module ``package`` (``build`` fills it); its calls."""
    calls: dict = {}
    fake = types.ModuleType(package)
    build(fake, calls)
    sys.modules[package] = fake
    try:
        trained = _train(rank, config, api)
    finally:
        del sys.modules[package]
    return {**trained, **calls}


@pytest.mark.parametrize("world", [1, 2])
def test_wandb_gets_the_runs_numbers_from_rank_0(dist, tmp_path, world):
    config = _config(str(tmp_path), wandb={"enabled": True, "project": "p", "group": "g", "team": "t"})
    results = dist.run(world, _train_beside_double, config, "zero", "wandb", _fake_wandb)
    first = results[0]
    assert first["init"] == [{"project": "p", "group": "g", "entity": "t"}] and first["finish"] == 1
    assert [step for step, _ in first["log"]] == [MICRO * ACCUM * world * (i + 1) for i in range(STEPS)]
    assert [d["Train/Samples/train_loss"] for _, d in first["log"]] == pytest.approx(
        first["losses"], rel=1e-6
    )
    assert [d["Train/Samples/lr"] for _, d in first["log"]] == first["lrs"]
    for other in results[1:]:
        assert other["init"] == [] and other["log"] == []


@pytest.mark.parametrize("world", [1, 2])
def test_comet_logs_each_event_once_per_sample_interval_from_rank_0(dist, tmp_path, world):
    per_step = MICRO * ACCUM * world
    comet = {"enabled": True, "project": "p", "workspace": "w", "experiment_name": "run", "api_key": "k3y"}
    config = _config(str(tmp_path), comet={**comet, "samples_log_interval": 2 * per_step, "mode": "create"})
    results = dist.run(world, _train_beside_double, config, "deepspeed", "comet_ml", _fake_comet)
    first = results[0]
    assert first["start"] == [
        {
            "api_key": "k3y",
            "project": "p",
            "workspace": "w",
            "experiment_key": None,
            "mode": "create",
            "online": None,
        }
    ]
    assert first["name"] == ["run"] and first["end"] == 1
    losses = [(step, value) for name, step, value in first["metrics"] if name == "Train/Samples/train_loss"]
    # steps at per_step, 2 per_step, 3 per_step: logged at the first and 2 x per_step after it
    assert [step for step, _ in losses] == [per_step, 3 * per_step]
    assert [v for _, v in losses] == pytest.approx([first["losses"][0], first["losses"][2]], rel=1e-6)
    lrs = [(step, value) for name, step, value in first["metrics"] if name == "Train/Samples/lr"]
    assert [v for _, v in lrs] == [first["lrs"][0], first["lrs"][2]]
    for other in results[1:]:
        assert other["start"] == [] and other["metrics"] == []


def test_comets_api_key_stays_out_of_the_configs_dumps_and_interval_0_logs_every_step():
    config, _ = validate_deepspeed({"comet": {"enabled": True, "api_key": "k3y", "samples_log_interval": 0}})
    assert config.comet.api_key.get_secret_value() == "k3y"
    dumped = json.dumps(config.model_dump(mode="json"))  # what checkpoint manifests and agreement use
    assert "k3y" not in dumped and "k3y" not in repr(config)
    calls: dict = {}
    fake = types.ModuleType("comet_ml")
    _fake_comet(fake, calls)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "comet_ml", fake)
        (writer,) = build_writers(config)
    writer.write([Event("a", 1.0, 4), Event("a", 2.0, 4), Event("a", 3.0, 8)])
    assert calls["start"][0]["api_key"] == "k3y"
    assert [(step, value) for _, step, value in calls["metrics"]] == [(4, 1.0), (4, 2.0), (8, 3.0)]


def test_a_missing_package_is_one_warning_naming_it(tmp_path, monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    config, _ = validate_deepspeed(
        _config(
            str(tmp_path),
            wandb={"enabled": True},
            csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
        )
    )
    with caplog.at_level(logging.WARNING, logger="zero.monitor"):
        writers = build_writers(config)
    assert [type(w).__name__ for w in writers] == ["CsvWriter"]  # the rest of the monitoring goes on
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'wandb' package is not installed (pip install wandb)" in warnings[0]


@pytest.mark.parametrize("world", [1, 2])
def test_comms_logger_table_counts_every_collective_of_the_engine(dist, tmp_path, world):
    config = _config(str(tmp_path), comms_logger={"enabled": True})
    results = dist.run(world, _train, config, "zero")
    printed = results[0]["printed"]
    assert printed.startswith("zero comms_logger")
    counts = [int(line.split()[-3]) for line in printed.splitlines()[2:] if line.startswith(" ")]
    assert sum(counts) == results[0]["comm_calls"] > 0
    assert "all_reduce" in printed  # the clipping norm
    for other in results[1:]:
        assert other["printed"] == ""


def test_steps_per_print_logs_a_progress_line_on_rank_0(dist, tmp_path):
    results = dist.run(2, _train, {**_config(str(tmp_path)), "steps_per_print": 2}, "zero")
    assert results[0]["progress"] == [f"zero: step=2, lr=[{results[0]['lrs'][1]}], loss_scale=1.0"]
    assert results[1]["progress"] == []


def _profiled(rank, config: dict) -> str:
    _train(rank, config, "zero")
    return Path(config["flops_profiler"]["output_file"]).read_text() if rank.rank == 0 else ""


def test_flops_profiler_counts_the_profiled_steps_forwards(dist, tmp_path):
    out = tmp_path / "flops.txt"
    config = _config(
        str(tmp_path), flops_profiler={"enabled": True, "profile_step": 1, "output_file": str(out)}
    )
    (text,) = dist.run(1, _profiled, config)
    linear = 2 * MICRO * (5 * 7 + 7 * 1)  # multiply-adds of both Linear layers
    assert f"fwd flops (rank 0):           {ACCUM * linear}" in text
    assert "forwards profiled:            2" in text and "params:                       50" in text
    assert f"fwd + bwd flops (estimate):   {3 * ACCUM * linear}" in text
    assert "depth 0: Sequential" in text
