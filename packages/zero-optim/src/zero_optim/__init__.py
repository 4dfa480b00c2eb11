"""Partitioned optimizers: ZeRO stage 1/2, stage 3 and MiCS, loss scaling, clipping.

* :class:`PartitionedOptimizer`: the core shared by every stage — per parameter group one
  flat fp32 master partition, one flat fp32 gradient partition and the user's torch
  optimizer re-mapped onto the flat masters (one optimizer call per step).
* :class:`Partitioning`: the stage-specific component (which elements this rank owns, how
  the parameters' tensors view the flat buffers, what happens after a step);
  :class:`Stage3Partitioning` for ZeRO-3.
* :class:`BucketedReducer`: the ``zero_coord.GradientSink`` that reduces gradients in
  static buckets during backward (``reduce_bucket_size``, ``overlap_comm``).
* :func:`stage3_optimizer`: both, wired for a partitioned model.
"""

from zero_optim.buckets import BucketedReducer, BucketPlan, ReduceConfig
from zero_optim.core import PartitionedOptimizer, Partitioning
from zero_optim.flat import FlatGroup, Segment
from zero_optim.spec import OptimizerSpec
from zero_optim.stage3 import Stage3Partitioning, stage3_optimizer

__all__ = [
    "BucketPlan",
    "BucketedReducer",
    "FlatGroup",
    "OptimizerSpec",
    "PartitionedOptimizer",
    "Partitioning",
    "ReduceConfig",
    "Segment",
    "Stage3Partitioning",
    "stage3_optimizer",
]
