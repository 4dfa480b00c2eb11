"""ZeRO++ (qwZ, hpZ, qgZ, quantized frozen weights) as strategy objects chosen from the config."""

from __future__ import annotations

import dataclasses
import logging
import os

from torch import nn
from torch.distributed import ProcessGroup

import zero_params
from zero_comm import AllGatherStrategy, FlatAllGather, ReduceScatterStrategy, Topology
from zero_full.config.zero_optimization import ZeroOptimizationConfig

__all__ = ["ZeroppStrategies", "build_zeropp", "check_zeropp_layout", "feedback_strategies"]

logger = logging.getLogger("zero.engine")


@dataclasses.dataclass(frozen=True)
class ZeroppStrategies:
    """The collective strategies of one ZeRO++ configuration on this rank (``None``: the default)."""

    gather: AllGatherStrategy | None = None
    secondary: AllGatherStrategy | None = None
    reduce: ReduceScatterStrategy | None = None
    hpz_size: int = 1


def env_ranks_per_node(world_size: int) -> int:
    """Ranks per node as the engine's ``zero_comm.Topology`` will see them (``LOCAL_WORLD_SIZE``).

    Unparsable values are left to ``Topology`` to refuse; here they count as one node.
    """
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        return world_size


def check_zeropp_layout(z: ZeroOptimizationConfig, world_size: int, ranks_per_node: int) -> None:
    """Refuse ZeRO++ settings that do not fit this world, or each other (every rank, no communication)."""
    if z.stage != 3:
        return
    hpz = z.zero_hpz_partition_size
    if hpz > 1:
        if world_size % hpz:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size = {hpz} does not divide the world size "
                f"{world_size}: the secondary (hpZ) groups must tile the world; use a divisor of "
                f"{world_size}, normally the ranks per node ({ranks_per_node})"
            )
        if hpz > ranks_per_node:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size = {hpz} is larger than a node "
                f"({ranks_per_node} ranks per node, LOCAL_WORLD_SIZE): the secondary shard must stay "
                f"inside a node so that backward gathers do not cross nodes; use at most {ranks_per_node}"
            )
        if ranks_per_node % hpz:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size = {hpz} does not divide the {ranks_per_node} "
                "ranks per node, so secondary groups would straddle nodes; use a divisor of "
                f"{ranks_per_node}"
            )
    if z.zero_quantized_gradients and (ranks_per_node < 1 or world_size % ranks_per_node):
        raise ValueError(
            f"zero_optimization.zero_quantized_gradients = true needs a world of whole nodes: world size "
            f"{world_size} is not a multiple of {ranks_per_node} ranks per node (LOCAL_WORLD_SIZE); qgZ's "
            "hierarchical all-to-all reduces inside each node, then across nodes. Launch the same number "
            "of ranks on every node"
        )
    if z.mics_enabled:
        _check_with_mics(z)


def _check_with_mics(z: ZeroOptimizationConfig) -> None:
    """MiCS + ZeRO++: qwZ (flat gather) and quantized frozen weights fit; hpZ and qgZ do not."""
    shard = f"mics_shard_size = {z.mics_shard_size}"
    if z.zero_hpz_partition_size > 1:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size = {z.zero_hpz_partition_size} cannot be combined "
            f"with MiCS ({shard}): MiCS already keeps each parameter's shards inside its shard group "
            "(normally a node), which is what hpZ's secondary shard gives backward; use one of the two"
        )
    if z.zero_quantized_gradients:
        raise ValueError(
            f"zero_optimization.zero_quantized_gradients = true cannot be combined with MiCS ({shard}): "
            "qgZ reduces over the whole world in two all-to-all hops, MiCS reduces inside the shard "
            "group and then averages across replicas; turn one of them off"
        )
    if z.zero_quantized_weights and z.mics_hierarchical_params_gather:
        raise ValueError(
            "zero_optimization.zero_quantized_weights = true cannot be combined with "
            "mics_hierarchical_params_gather = true: the two-hop MiCS gather has no quantized form; "
            "keep qwZ with the flat MiCS gather (mics_hierarchical_params_gather = false)"
        )


def build_zeropp(
    z: ZeroOptimizationConfig, topology: Topology, shard_group: ProcessGroup | None
) -> ZeroppStrategies:
    """Validate and create this rank's ZeRO++ strategies (collective when it makes groups)."""
    check_zeropp_layout(z, topology.world_size, topology.ranks_per_node)
    if not z.zeropp_enabled:
        return ZeroppStrategies()
    gather: AllGatherStrategy | None = None
    reduce: ReduceScatterStrategy | None = None
    secondary: AllGatherStrategy | None = None
    if z.zero_quantized_weights:
        from zero_comm.quantized import QuantizedAllGather

        gather = QuantizedAllGather(shard_group)
    hpz = z.zero_hpz_partition_size
    if 1 < hpz < topology.world_size:
        secondary = FlatAllGather(topology.shard_group(hpz))
    elif hpz > 1:
        logger.info(
            "zero: zero_hpz_partition_size = %d spans the whole world: the primary shard is already "
            "node-local, no secondary shard is kept",
            hpz,
        )
    if z.zero_quantized_gradients:
        if z.loco_enabled:
            from zero_comm.qgz_feedback import ErrorFeedbackReduceScatter

            reduce = ErrorFeedbackReduceScatter(topology, z.zeropp_loco_param.to_feedback_config())
        else:
            from zero_comm.quantized import QuantizedReduceScatter

            reduce = QuantizedReduceScatter(topology)
    return ZeroppStrategies(
        gather=gather, secondary=secondary, reduce=reduce, hpz_size=hpz if secondary is not None else 1
    )


def feedback_strategies(model: nn.Module) -> list[object]:
    """The error-feedback qgZ strategies the model's parameters reduce through (each once)."""
    from zero_comm.qgz_feedback import ErrorFeedbackReduceScatter

    found: dict[int, object] = {}
    for p in model.parameters():
        if zero_params.is_partitioned(p):
            strategy = zero_params.state_of(p).reduce_strategy
            if isinstance(strategy, ErrorFeedbackReduceScatter):
                found.setdefault(id(strategy), strategy)
    return list(found.values())
