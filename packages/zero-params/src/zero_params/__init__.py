"""Partitioned parameters for ZeRO-3: the ShardedParam state, partition / gather / release,
Init and GatheredParameters.
"""

from zero_params import commit, frozen, gathered_parameters, grad_reduce, init, offload, spec, state
from zero_params.commit import commit_shards
from zero_params.external import (
    ModuleParamsState,
    external_parameters,
    register_external_parameter,
    unregister_external_parameter,
)
from zero_params.frozen import FrozenInt8Gather, FrozenInt8Store, quantize_frozen
from zero_params.gather_release import GatherHandle, GatherPlan, gather, release
from zero_params.gathered_parameters import GatheredParameters
from zero_params.grad_reduce import GradReduceHandle, reduce_scatter_grads
from zero_params.hpz import invalidate_secondary
from zero_params.init import Init
from zero_params.offload import OffloadedShards
from zero_params.partitioning import partition
from zero_params.spec import ShardingSpec
from zero_params.state import (
    ParamStatus,
    PartitionedParameter,
    PartitionedParameterError,
    SavedTensorGuard,
    ShardedParam,
    ShardHome,
    UnshardedStorage,
    full_shape,
    is_partitioned,
    state_of,
)

__all__ = [
    "GatherHandle",
    "GatherPlan",
    "ModuleParamsState",
    "external_parameters",
    "gather",
    "invalidate_secondary",
    "partition",
    "register_external_parameter",
    "release",
    "unregister_external_parameter",
    *commit.__all__,
    *frozen.__all__,
    *gathered_parameters.__all__,
    *grad_reduce.__all__,
    *init.__all__,
    *offload.__all__,
    *spec.__all__,
    *state.__all__,
]
