"""DeepSpeed's monitoring sections: ``tensorboard``, ``wandb``, ``comet``, ``csv_monitor``,
``comms_logger``, ``flops_profiler``.

Each is a top-level section of a DeepSpeed config with DeepSpeed's keys and defaults;
:mod:`zero_full.monitor` builds one writer per enabled section, fed by the engine after each
optimizer step on rank 0 (see the DeepSpeed migration page for the files and events).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import SecretStr

from zero_full.config.base import Section
from zero_full.config.types import USED, Flag, Ignored, Int, Key

__all__ = [
    "CometConfig",
    "CommsLoggerConfig",
    "CsvMonitorConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "WandbConfig",
]

_JOB = "DeepSpeedJobName"


class _JobDirectorySection(Section):
    """A monitoring section whose writer puts its files in the directory ``output_path/job_name``."""

    enabled: Annotated[Flag, USED] = False
    """Write the step's events to this section's files (rank 0)."""
    output_path: Annotated[str, USED] = ""
    """Directory of the job directories (``""``: the working directory)."""
    job_name: Annotated[str, USED] = _JOB
    """The directory inside ``output_path`` the files are written to."""


class TensorBoardConfig(_JobDirectorySection):
    """``tensorboard``: scalar events under ``output_path/job_name`` (needs the ``tensorboard`` package),
    in one event file written with ``torch.utils.tensorboard.SummaryWriter``."""

    _PATH: ClassVar[tuple[str, ...]] = ("tensorboard",)


class WandbConfig(Section):
    """``wandb``: the step's events logged to a Weights & Biases run (needs the ``wandb`` package)."""

    _PATH: ClassVar[tuple[str, ...]] = ("wandb",)

    enabled: Annotated[Flag, USED] = False
    """Start a run with ``wandb.init`` and ``wandb.log`` each event (rank 0)."""
    group: Annotated[str | None, USED] = None
    """The run's group (``wandb.init(group=...)``)."""
    team: Annotated[str | None, USED] = None
    """The team, W&B's entity (``wandb.init(entity=...)``)."""
    project: Annotated[str, USED] = "deepspeed"
    """The project (``wandb.init(project=...)``)."""


class CometConfig(Section):
    """``comet``: the step's events logged to a Comet experiment (needs the ``comet_ml`` package).

    Keys left ``null`` are left to Comet's own configuration (``.comet.config``, ``COMET_*``
    environment variables), as DeepSpeed does.
    """

    _PATH: ClassVar[tuple[str, ...]] = ("comet",)

    enabled: Annotated[Flag, USED] = False
    """Start an experiment with ``comet_ml.start`` and log each event to it (rank 0)."""
    samples_log_interval: Annotated[Int(0), USED] = 100
    """An event is logged again only after this many more samples (its first value always; 0:
    every step)."""
    project: Annotated[str | None, USED] = None
    """The Comet project."""
    workspace: Annotated[str | None, USED] = None
    """The Comet workspace."""
    api_key: Annotated[SecretStr | None, USED] = None
    """The Comet API key (kept out of the config's dumps: checkpoint manifests, agreement messages)."""
    experiment_name: Annotated[str | None, USED] = None
    """The experiment's name (``experiment.set_name``)."""
    experiment_key: Annotated[str | None, USED] = None
    """The key of the experiment to log to (32 to 50 alphanumeric characters)."""
    online: Annotated[bool | None, USED] = None
    """Log to the Comet server (``false``: an offline experiment stored locally)."""
    mode: Annotated[Literal["get", "create", "get_or_create"] | None, USED] = None
    """``"get"``, ``"create"`` or ``"get_or_create"`` (Comet's default)."""


class CsvMonitorConfig(_JobDirectorySection):
    """``csv_monitor``: one CSV file per event under ``output_path/job_name`` (no package needed),
    ``<event name with / as _>.csv`` with the header ``step,<last name part>``."""

    _PATH: ClassVar[tuple[str, ...]] = ("csv_monitor",)


class CommsLoggerConfig(Section):
    """``comms_logger``: the engine's collectives (zero's byte ledger) summed by operation and size.

    The table (operation, message size, count, total bytes sent) is printed on rank 0 when the
    engine closes; zero times no single collective, so the table has no latency or bandwidth.
    """

    _PATH: ClassVar[tuple[str, ...]] = ("comms_logger",)

    enabled: Annotated[Flag, USED] = False
    """Count the engine's collectives and print their table at ``close()``."""
    verbose: Annotated[Flag, USED] = False
    """Also log every collective (operation, message size, bytes sent) after each optimizer step."""
    prof_all: Annotated[Flag, USED] = True
    """Count every operation (``false``: only those in ``prof_ops``)."""
    prof_ops: Annotated[tuple[str, ...], USED] = ()
    """Operations counted when ``prof_all`` is false (zero's names: ``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``all_to_all``)."""
    debug: Annotated[
        Flag, Key(Ignored("zero's records carry no caller name to add to the table", behaves_as=False))
    ] = False
    """DeepSpeed: name each record after the function that issued it."""


class FlopsProfilerConfig(Section):
    """``flops_profiler``: the forward's floating-point operations at one step (torch's flop counter)."""

    _PATH: ClassVar[tuple[str, ...]] = ("flops_profiler",)

    enabled: Annotated[Flag, USED] = False
    """Profile the forwards of one optimizer step on rank 0."""
    recompute_fwd_factor: Annotated[float, USED] = 0.0
    """Share of the forward recomputed in the backward (activation checkpointing), added to the estimate."""
    profile_step: Annotated[Int(0), USED] = 1
    """The optimizer step (counted from 0) whose forwards are profiled."""
    module_depth: Annotated[Int(-1), USED] = -1
    """Deepest module level shown (-1: every level)."""
    top_modules: Annotated[Int(1), USED] = 1
    """Modules shown per level, most FLOPs first."""
    detailed: Annotated[Flag, USED] = True
    """Show the per-module table (``false``: the totals only)."""
    output_file: Annotated[str | None, USED] = None
    """Write the report to this file instead of printing it."""
