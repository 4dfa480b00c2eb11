"""CPU / NVMe placement of optimizer state and parameters, async swapping, CPU Adam."""

from zero_offload import (
    cpu_adam,
    destination,
    host_optimizer,
    optimizer,
    params,
    placement,
    pool,
    swap,
    transfers,
)
from zero_offload.cpu_adam import AdamHyper, AdamKernel, CpuAdam, adam_hyper_from_group, check_offloadable
from zero_offload.destination import OffloadDestination, OffloadTarget
from zero_offload.host_optimizer import HostOptimizer, PartialOffload, offload_optimizer_for, twin_optimizer
from zero_offload.optimizer import OffloadedOptimizer, OptimizerOffloadConfig, TransferStats
from zero_offload.params import ParamOffloadConfig, ParamSwapper, ParamTransferStats, ShardResidence
from zero_offload.placement import (
    CopyStream,
    HostMemory,
    HostPlacement,
    Inline,
    SideStream,
    copy_stream_for,
    host_memory,
    host_placement,
)
from zero_offload.pool import ALIGNMENT, BufferPool, align_up, aligned_empty
from zero_offload.swap import (
    AsyncSwapper,
    IoMode,
    SwapError,
    SwapHandle,
    SwapSpaceError,
    SwapStats,
    detect_io_mode,
    payload_checksum,
)
from zero_offload.transfers import Transfers

__all__: list[str] = []
__all__ += cpu_adam.__all__
__all__ += destination.__all__
__all__ += host_optimizer.__all__
__all__ += optimizer.__all__
__all__ += params.__all__
__all__ += placement.__all__
__all__ += pool.__all__
__all__ += swap.__all__
__all__ += transfers.__all__
