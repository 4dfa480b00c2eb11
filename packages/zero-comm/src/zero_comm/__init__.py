"""Coalesced, hierarchical and quantized collectives over torch.distributed."""

import importlib

from zero_comm import (
    cast,
    grad_bound,
    handles,
    in_place,
    ledger,
    partition,
    primitives,
    reduction,
    staged,
    strategies,
    streams,
    teardown,
    wait_timings,
)
from zero_comm.cast import COMM_DTYPES, CastAllGather, CastAllReduce, CastReduceScatter
from zero_comm.coalesced import (
    GatherIntoPlan,
    all_gather_coalesced,
    all_gather_coalesced_into,
    reduce_scatter_coalesced,
    reduce_scatter_coalesced_padded,
)
from zero_comm.completion import wait_polled
from zero_comm.devices import control_device, served_device_types
from zero_comm.grad_bound import BOUNDED_DTYPES, BoundedReduceScatter, GradientBound
from zero_comm.handles import AllGatherHandle, CollectiveHandle, ReduceScatterHandle, TensorHandle
from zero_comm.hierarchical import hierarchical_all_gather_coalesced
from zero_comm.in_place import reduce_scatter_in_place
from zero_comm.ledger import CommLedger, CommRecord, CommTotals, record, ring_wire_bytes
from zero_comm.native import NativeReduceScatter, has_native_reduce_scatter, reduce_scatter_strategy
from zero_comm.partition import padded_numel, partition_numel, shard_range
from zero_comm.primitives import all_reduce, all_to_all_single, broadcast
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.staged import StagedReduceScatter
from zero_comm.strategies import (
    AllGatherStrategy,
    AllToAllReduceScatter,
    FlatAllGather,
    GroupPosition,
    HierarchicalAllGather,
    ReduceScatterStrategy,
)
from zero_comm.streams import (
    NO_STREAMS,
    AcceleratorStreamSource,
    CommStreams,
    NoStreams,
    StreamSource,
    comm_streams,
)
from zero_comm.teardown import BoundedTimeouts, bound_for
from zero_comm.topology import HierarchicalGroups, LinkKind, Topology, group_ranks
from zero_comm.wait_timings import WaitRecord, WaitTimings
from zero_comm.watchdog import (
    CollectiveTimeoutError,
    CommWatchdog,
    RankPosition,
    RanksDivergedError,
)
from zero_comm.watched import note_collectives

__all__ = [
    "CollectiveTimeoutError",
    "CommWatchdog",
    "GatherIntoPlan",
    "HierarchicalGroups",
    "LinkKind",
    "NativeReduceScatter",
    "RankPosition",
    "RanksDivergedError",
    "Topology",
    "all_gather_coalesced",
    "all_gather_coalesced_into",
    "control_device",
    "group_ranks",
    "has_native_reduce_scatter",
    "hierarchical_all_gather_coalesced",
    "note_collectives",
    "reduce_scatter_coalesced",
    "reduce_scatter_coalesced_padded",
    "reduce_scatter_strategy",
    "served_device_types",
    "wait_polled",
]
__all__ += cast.__all__
__all__ += grad_bound.__all__
__all__ += handles.__all__
__all__ += in_place.__all__
__all__ += ledger.__all__
__all__ += partition.__all__
__all__ += primitives.__all__
__all__ += reduction.__all__
__all__ += staged.__all__
__all__ += strategies.__all__
__all__ += streams.__all__
__all__ += teardown.__all__
__all__ += wait_timings.__all__

_QUANTIZED = frozenset(
    {
        "QuantizedAllGather",
        "QuantizedReduceScatter",
        "all_to_all_quant_reduce",
        "quantized_all_gather_coalesced",
    }
)


_FEEDBACK = frozenset({"ErrorFeedbackConfig", "ErrorFeedbackReduceScatter"})


_MOVED = frozenset(  # now zero_full.memory.rank_memory's
    {
        "DeviceMemory",
        "MemorySource",
        "ProcessMemory",
        "read_device_memory",
        "read_process_memory",
        "reset_device_peak",
        "reset_process_peak",
    }
)


def __getattr__(name: str) -> object:
    """Lazy exports of :mod:`zero_comm.quantized` and :mod:`zero_comm.qgz_feedback`, which need
    the optional zero-kernels package."""
    if name in _QUANTIZED:
        return getattr(importlib.import_module("zero_comm.quantized"), name)
    if name in _FEEDBACK:
        return getattr(importlib.import_module("zero_comm.qgz_feedback"), name)
    if name in _MOVED:  # moved to the package that uses them (zero-comm cannot import from above)
        raise AttributeError(f"zero_comm.{name} moved: import it from zero_full.memory.rank_memory")
    raise AttributeError(f"module 'zero_comm' has no attribute {name!r}")
