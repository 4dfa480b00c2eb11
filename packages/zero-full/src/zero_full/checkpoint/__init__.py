"""Sharded, atomic, world-size-independent checkpoints of a training run.

The engine hands its :class:`TrainState` (module, optimizer, config, step counters, loss
scaler, MiCS groups) to these functions; nothing here imports the engine.

:func:`save_checkpoint` writes one shard file per rank into a temporary directory renamed into
place only when complete (a failed save leaves earlier checkpoints and ``latest`` untouched);
:func:`load_checkpoint` reads at any world size and stage, each rank only the pieces of its own
partition; :func:`load_deepspeed_checkpoint` reads DeepSpeed's; :func:`consolidated_state_dict`
gathers the full weights. Exchanges wait at most ``robustness.comm_timeout`` seconds.
"""

from zero_full.checkpoint.consolidate import consolidated_state_dict, iter_consolidated
from zero_full.checkpoint.deepspeed_format import is_deepspeed_checkpoint, load_deepspeed_checkpoint
from zero_full.checkpoint.extras import read_client_state
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.load import LoadOptions, load_checkpoint, plan_reads
from zero_full.checkpoint.manifest import FileEntry, Manifest
from zero_full.checkpoint.save import SaveOptions, save_checkpoint
from zero_full.checkpoint.state import LRSchedulerLike, StepCounters, TrainState

__all__ = [
    "CheckpointError",
    "FileEntry",
    "LRSchedulerLike",
    "LoadOptions",
    "Manifest",
    "SaveOptions",
    "StepCounters",
    "TrainState",
    "consolidated_state_dict",
    "is_deepspeed_checkpoint",
    "iter_consolidated",
    "load_checkpoint",
    "load_deepspeed_checkpoint",
    "plan_reads",
    "read_client_state",
    "save_checkpoint",
]
