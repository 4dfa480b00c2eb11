"""Monitoring of a training run from DeepSpeed's config sections (rank 0, after each optimizer step).

:class:`TrainingMonitor` is the engine's one object for it, built from the config: one
:class:`~zero_full.monitor.writers.Writer` per enabled section (``csv_monitor``,
``tensorboard``, ``wandb``), the collective table of ``comms_logger`` and the FLOP count of
``flops_profiler``. The engine calls :meth:`TrainingMonitor.record_loss` in each backward and
:meth:`TrainingMonitor.after_step` after each optimizer step; the events are named as
DeepSpeed names them (``Train/Samples/lr``, ...), with the samples seen as their step.
"""

from zero_full.monitor.training import StepEvent, TrainingMonitor
from zero_full.monitor.writers import Writer, build_writers

__all__ = ["StepEvent", "TrainingMonitor", "Writer", "build_writers"]
