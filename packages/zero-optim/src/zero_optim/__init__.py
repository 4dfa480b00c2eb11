"""Partitioned optimizers: ZeRO stage 1/2, stage 3 and MiCS, loss scaling, clipping."""

from zero_optim.buckets import BucketedReducer, BucketPlan, ReduceConfig
from zero_optim.clip import clip_grad_norm_, global_grad_norm
from zero_optim.core import PartitionedOptimizer, Partitioning
from zero_optim.flat import FlatGroup, GradLayout, Segment
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
    "GradLayout",
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
