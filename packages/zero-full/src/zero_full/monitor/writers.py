"""The monitoring backends, one :class:`Writer` per enabled config section, chosen once.

* :class:`CsvWriter` (``csv_monitor``): DeepSpeed's layout, one file per event under
  ``output_path/job_name``, named after the event with ``/`` as ``_``, header ``step,<last part>``;
* :class:`TensorBoardWriter` (``tensorboard``): ``SummaryWriter(output_path/job_name).add_scalar``;
* :class:`WandbWriter` (``wandb``): ``wandb.init(project, group, entity=team)`` and ``wandb.log``;
* :class:`CometWriter` (``comet``): ``comet_ml.start(...)`` and ``log_metric`` per event, each
  event at most once per ``samples_log_interval`` samples (DeepSpeed's rule).
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from zero_full.config.monitoring import CometConfig
from zero_full.config.zero_config import ZeroConfig

__all__ = ["CometWriter", "CsvWriter", "Event", "TensorBoardWriter", "WandbWriter", "Writer", "build_writers"]

logger = logging.getLogger("zero.monitor")


class Event(NamedTuple):
    """One scalar: DeepSpeed's ``(name, value, step)`` tuple."""

    name: str
    value: float
    step: int


class Writer(Protocol):
    """A monitoring backend: takes each optimizer step's events, released at the engine's close."""

    def write(self, events: Sequence[Event]) -> None:
        """Record the events of one optimizer step."""

    def close(self) -> None:
        """Flush and release what the writer holds."""


def _job_dir(output_path: str, job_name: str) -> str:
    path = os.path.join(output_path, job_name)
    os.makedirs(path, exist_ok=True)
    return path


class CsvWriter:
    """``csv_monitor``: appends ``step,value`` rows to one CSV file per event."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.directory = _job_dir(output_path, job_name)
        self._started: set[str] = set()

    def write(self, events: Sequence[Event]) -> None:
        for event in events:
            filename = event.name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.directory, filename + ".csv"), "a+", newline="") as f:
                rows = csv.writer(f)
                if filename not in self._started:
                    self._started.add(filename)
                    rows.writerow(["step", event.name.split("/")[-1]])
                rows.writerow([event.step, event.value])

    def close(self) -> None:
        """Nothing held: every row is written when it comes."""


class TensorBoardWriter:
    """``tensorboard``: one scalar per event, flushed after each step."""

    def __init__(self, output_path: str, job_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=_job_dir(output_path, job_name))

    def write(self, events: Sequence[Event]) -> None:
        for event in events:
            self.writer.add_scalar(event.name, event.value, event.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """``wandb``: one ``wandb.log`` of the step's events."""

    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        self.wandb: Any = importlib.import_module("wandb")
        self.run = self.wandb.init(project=project, group=group, entity=team)

    def write(self, events: Sequence[Event]) -> None:
        if events:
            self.wandb.log({e.name: e.value for e in events}, step=events[0].step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class CometWriter:
    """``comet``: ``log_metric`` per event, an event again only ``samples_log_interval`` samples later."""

    def __init__(self, config: CometConfig) -> None:
        comet_ml: Any = importlib.import_module("comet_ml")
        given = config.model_dump(include={"project", "workspace", "experiment_key", "mode", "online"})
        key = config.api_key.get_secret_value() if config.api_key is not None else None
        self.experiment = comet_ml.start(api_key=key, **given)
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self.interval = config.samples_log_interval
        self._logged_at: dict[str, int] = {}

    def write(self, events: Sequence[Event]) -> None:
        for event in events:
            last = self._logged_at.get(event.name)
            if last is None or event.step - last >= self.interval:
                self._logged_at[event.name] = event.step
                self.experiment.log_metric(event.name, event.value, step=event.step)

    def close(self) -> None:
        self.experiment.end()


def _installed(section: str, package: str) -> bool:
    if package in sys.modules or importlib.util.find_spec(package) is not None:
        return True
    logger.warning(
        "zero: %s.enabled is true but the %r package is not installed (pip install %s): no %s "
        "events are written; the run goes on",
        section,
        package,
        package,
        section,
    )
    return False


def build_writers(config: ZeroConfig) -> list[Writer]:
    """One writer per enabled monitoring section whose package is installed (call on rank 0 only)."""
    writers: list[Writer] = []
    csv_cfg, tb, wb = config.csv_monitor, config.tensorboard, config.wandb
    if csv_cfg.enabled:
        writers.append(CsvWriter(csv_cfg.output_path, csv_cfg.job_name))
    if tb.enabled and _installed("tensorboard", "tensorboard"):
        writers.append(TensorBoardWriter(tb.output_path, tb.job_name))
    if wb.enabled and _installed("wandb", "wandb"):
        writers.append(WandbWriter(wb.project, wb.group, wb.team))
    if config.comet.enabled and _installed("comet", "comet_ml"):
        writers.append(CometWriter(config.comet))
    return writers
