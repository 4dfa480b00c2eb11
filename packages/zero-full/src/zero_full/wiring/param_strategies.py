"""Which collectives move stage 3's parameters and gradients: one choice for ``build_stage`` and ``Init``.

MiCS (``mics_shard_size``) partitions over a shard group and picks its flat or hierarchical
gather; without it ``communication_data_type`` may pick cast collectives; ZeRO++ then replaces
the gather (qwZ) and the gradient reduce-scatter (qgZ) where it has its own, and adds the hpZ
secondary gather. The config refuses the combinations that would contradict each other.
"""

from __future__ import annotations

import dataclasses

from torch.distributed import ProcessGroup

from zero_comm import AllGatherStrategy, ReduceScatterStrategy, Topology
from zero_full.config.zero_config import ZeroConfig
from zero_full.wiring.comm_dtype import CommStrategies, comm_strategies
from zero_full.wiring.mics import MicsGroups, build_mics_groups
from zero_full.wiring.zeropp import ZeroppStrategies, build_zeropp

__all__ = ["ParamStrategies", "param_strategies"]


@dataclasses.dataclass(frozen=True)
class ParamStrategies:
    """The strategies one config selects for partitioned parameters on this rank."""

    mics: MicsGroups | None = None
    comm: CommStrategies = CommStrategies()
    zeropp: ZeroppStrategies | None = None

    @property
    def base_gather(self) -> AllGatherStrategy | None:
        """The gather before ZeRO++: MiCS's, or the cast gather of ``communication_data_type``."""
        return self.mics.gather_strategy if self.mics is not None else self.comm.gather

    @property
    def base_reduce(self) -> ReduceScatterStrategy | None:
        """The gradient reduce-scatter before ZeRO++ (``communication_data_type``'s cast one)."""
        return self.comm.reduce_scatter

    @property
    def gather(self) -> AllGatherStrategy | None:
        """The parameter all-gather (``None``: the plain one)."""
        zpp = self.zeropp.gather if self.zeropp is not None else None
        return zpp if zpp is not None else self.base_gather

    @property
    def reduce(self) -> ReduceScatterStrategy | None:
        """The gradient reduce-scatter (``None``: the plain one)."""
        zpp = self.zeropp.reduce if self.zeropp is not None else None
        return zpp if zpp is not None else self.base_reduce

    @property
    def secondary(self) -> AllGatherStrategy | None:
        """The hpZ secondary all-gather (``None``: no secondary shard)."""
        return self.zeropp.secondary if self.zeropp is not None else None


def param_strategies(
    config: ZeroConfig,
    topology: Topology | None = None,
    group: ProcessGroup | None = None,
    *,
    mics: bool = True,
) -> ParamStrategies:
    """Build the strategies (and MiCS / hpZ groups: collective when it makes groups)."""
    z = config.zero_optimization
    stage3 = config.stage == 3
    use_mics = mics and stage3 and z.mics_enabled
    if use_mics or z.zeropp_enabled:
        topology = topology if topology is not None else Topology()
    groups = build_mics_groups(z, topology) if use_mics else None
    shard = groups.shard if groups is not None else group
    comm = comm_strategies(config, shard) if stage3 and groups is None else CommStrategies()
    zeropp = build_zeropp(z, topology, shard) if z.zeropp_enabled else None
    return ParamStrategies(groups, comm, zeropp)
