"""Monitoring of a training run from DeepSpeed's config sections (rank 0, after each optimizer step)."""

from zero_full.monitor.training import StepEvent, TrainingMonitor
from zero_full.monitor.writers import Writer, build_writers

__all__ = ["StepEvent", "TrainingMonitor", "Writer", "build_writers"]
