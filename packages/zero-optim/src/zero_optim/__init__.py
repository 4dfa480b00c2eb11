"""Partitioned optimizers: ZeRO stage 1/2, stage 3 and MiCS, loss scaling, clipping.

* :class:`PartitionedOptimizer`: the core shared by every stage — per parameter group one
  flat fp32 master partition (for stages 1 and 2 in fp32: the parameters themselves), one
  fp32 gradient partition and the user's torch optimizer re-mapped onto the flat masters,
  stepped ``sub_group_size`` elements at a time (:class:`SubGroupStepper`).
* :class:`Partitioning`: the stage-specific component (which elements this rank owns, how
  the parameters' tensors view the flat buffers, what happens after a step);
  :class:`Stage3Partitioning` for ZeRO-3.
* :class:`BucketedReducer`: the ``zero_coord.GradientSink`` that reduces gradients in
  static buckets during backward (``reduce_bucket_size``, ``overlap_comm``).
* :func:`stage3_optimizer`: both, wired for a partitioned model.
* MiCS (:mod:`zero_optim.mics`): the stage-3 optimizer over a shard-group partition plus
  :class:`ReplicaGradientSync`, the boundary all-reduce of the gradient partitions across
  the replicate group, and :func:`check_replicas_consistent`, a debug check that the
  replicas hold identical optimizer state.
* :func:`replicated_optimizer`: stages 0, 1 and 2 on the same core (whole parameters,
  :class:`ReplicaPartitioning`, a :class:`GradientReduction`).
* :class:`LossScaler` / :func:`found_overflow`: fp16 loss scaling and the cross-rank
  overflow check (stages 1, 2 and 3 without MiCS carry it in their reduce-scatter instead:
  ``zero_comm.GradientBound``); :func:`clip_grad_norm_`: global-norm clipping
  over partitions.
"""

from zero_optim.buckets import BucketedReducer, BucketPlan, ReduceConfig
from zero_optim.clip import clip_grad_norm_, global_grad_norm
from zero_optim.core import PartitionedOptimizer, Partitioning
from zero_optim.flat import FlatGroup, Segment
from zero_optim.mics import ReplicaGradientSync, ReplicaMismatchError, check_replicas_consistent
from zero_optim.reductions import BackwardReduction, BoundaryReduction, GradientReduction, HookedReduction
from zero_optim.scaler import LossScaler, LossScalerConfig, found_overflow
from zero_optim.spec import OptimizerSpec
from zero_optim.stage3 import Stage3Partitioning, offloaded_shards, stage3_optimizer
from zero_optim.stage12 import (
    AllReduceInto,
    ReduceScatterInPlace,
    ReduceScatterInto,
    ReplicaPartitioning,
    replicated_optimizer,
)
from zero_optim.subgroups import SubGroupStepper

__all__ = [
    "AllReduceInto",
    "BackwardReduction",
    "BoundaryReduction",
    "BucketPlan",
    "BucketedReducer",
    "FlatGroup",
    "GradientReduction",
    "HookedReduction",
    "LossScaler",
    "LossScalerConfig",
    "OptimizerSpec",
    "PartitionedOptimizer",
    "Partitioning",
    "ReduceConfig",
    "ReduceScatterInPlace",
    "ReduceScatterInto",
    "ReplicaGradientSync",
    "ReplicaMismatchError",
    "ReplicaPartitioning",
    "Segment",
    "Stage3Partitioning",
    "SubGroupStepper",
    "check_replicas_consistent",
    "clip_grad_norm_",
    "found_overflow",
    "global_grad_norm",
    "replicated_optimizer",
    "offloaded_shards",
    "stage3_optimizer",
]
