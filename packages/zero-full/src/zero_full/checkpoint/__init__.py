"""Sharded, atomic, world-size-independent checkpoints of a training run.

The engine hands its :class:`TrainState` (module, optimizer, config, step counters, loss
scaler, MiCS groups) to these functions; nothing here imports the engine.

* :func:`save_checkpoint` (module :mod:`zero_full.checkpoint.save`): every rank writes its own
  shard file, rank 0 the buffers and, once every rank reported success, the
  :class:`Manifest` (:mod:`zero_full.checkpoint.manifest`; files and on-disk layout:
  :mod:`zero_full.checkpoint.io`). Everything is written into ``DIR/TAG.tmp-<random>`` and
  renamed to ``DIR/TAG`` only when complete; ``DIR/latest`` moves after that. A save that
  fails (or dies) on any rank leaves the previous checkpoints and ``latest`` untouched and no
  ``DIR/TAG``. Free space is checked first; an I/O error names the file, the rank and the OS
  error; temporary directories of saves that did not complete are removed at the next save or
  load (:mod:`zero_full.checkpoint.hygiene`).
* :func:`load_checkpoint` (module :mod:`zero_full.checkpoint.load`): checks the checkpoint
  against the model (all mismatches at once), then each rank reads only the pieces
  overlapping its own partition of each parameter (:mod:`zero_full.checkpoint.layout`),
  whatever world size and stage wrote them, after verifying each file against its sha256;
  the optimizer then publishes the loaded masters. :class:`LoadOptions` narrows what is
  restored; :class:`SaveOptions` adds a client state, replaces a tag atomically, leaves
  frozen parameters out. The LR scheduler's state and the client state live in
  ``extras.pt`` (:mod:`zero_full.checkpoint.extras`; :func:`read_client_state`).
* :func:`load_deepspeed_checkpoint` (module :mod:`zero_full.checkpoint.deepspeed_format`): reads
  a checkpoint DeepSpeed wrote (ZeRO stages 1-3) at any world size, weights and optimizer state,
  without running pickled code; :func:`is_deepspeed_checkpoint` recognises one.
* :func:`consolidated_state_dict` (module :mod:`zero_full.checkpoint.consolidate`): the full
  fp32 weights, gathered one parameter at a time; :mod:`zero_full.checkpoint.safetensors`
  writes a saved checkpoint as one safetensors file offline (``zero consolidate``).

The ranks' exchanges wait at most ``robustness.comm_timeout`` seconds
(:mod:`zero_full.checkpoint.collectives`): a rank that dies or stops taking part makes the
others raise :class:`CheckpointError` within that bound instead of hanging.
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
