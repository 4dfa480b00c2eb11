"""Coalesced, hierarchical and quantized collectives over torch.distributed.

Topology, process groups and byte accounting for the zero stack:

* :class:`Topology`: nodes and ranks, cached process groups (intra / inter node, MiCS and
  hpZ shard and replicate groups, hierarchical hops).
* :func:`all_gather_coalesced` (and :func:`all_gather_coalesced_into`, straight into
  destinations; :class:`GatherIntoPlan`, the same gather planned once and issued again and
  again), :func:`reduce_scatter_coalesced` (each rank's unpadded partitions, as
  DeepSpeed's; :func:`reduce_scatter_coalesced_padded` keeps the padding;
  :func:`reduce_scatter_in_place` writes each rank's reduced row into the padded inputs),
  :func:`hierarchical_all_gather_coalesced`: one collective for many tensors. As in
  ``torch.distributed``, a call returns its result; with ``async_op=True`` it returns a
  handle whose ``.wait()`` returns it.
* Strategies (:class:`FlatAllGather`, :class:`HierarchicalAllGather`,
  :class:`AllToAllReduceScatter`) implementing the :class:`AllGatherStrategy` /
  :class:`ReduceScatterStrategy` protocols (both a :class:`GroupPosition`: ``group_size``,
  ``group_rank``).
* Casting strategies (:class:`CastAllGather`, :class:`CastReduceScatter`,
  :class:`CastAllReduce`): fp32 tensors communicated as bf16 / fp16 (``communication_data_type``).
* :class:`GradientBound`: an inf / nan check carried by a gradient reduce-scatter (a sideband
  of one element per rank), so the ranks agree without a collective of its own.
* :class:`CommLedger`: per-step record of every collective's payload and ring-ideal
  wire bytes, by link kind.
* :class:`CommWatchdog`: records what each rank is doing, heartbeats it to the process
  group's store, and turns a stuck collective into :class:`CollectiveTimeoutError` on every
  live rank saying which rank is where (:func:`note_collectives` labels the next collectives).
* :func:`control_device`: where a collective's small control-plane tensors go, the device the
  process group serves (:func:`served_device_types`: the CPU under gloo, the accelerator alone
  under NCCL); :func:`wait_polled`: a wait that polls completion, never a timed wait on the
  backend (on NCCL one aborts the communicator when it expires).
* Quantized collectives (ZeRO++ qwZ / qgZ, module :mod:`zero_comm.quantized`, optional extra
  ``pip install zero-comm[quantized]``): :class:`QuantizedAllGather`,
  :func:`quantized_all_gather_coalesced`, :class:`QuantizedReduceScatter`,
  :func:`all_to_all_quant_reduce`; qgZ with error feedback (module :mod:`zero_comm.qgz_feedback`):
  :class:`ErrorFeedbackReduceScatter`, :class:`ErrorFeedbackConfig`. Exported lazily:
  ``import zero_comm`` never imports zero-kernels; the first use of one of these names does
  (ImportError naming the extra if it is missing).
"""

import importlib

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
from zero_comm.grad_bound import BOUNDED_DTYPES, GradientBound
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
from zero_comm.teardown import BoundedTimeouts, bound_for
from zero_comm.topology import HierarchicalGroups, LinkKind, Topology, group_ranks
from zero_comm.wait_timings import WaitRecord, WaitTimings
from zero_comm.watchdog import (
    CollectiveTimeoutError,
    CommWatchdog,
    RankPosition,
    RanksDivergedError,
    note_collectives,
)

__all__ = [
    "AllGatherHandle",
    "AllGatherStrategy",
    "AllToAllReduceScatter",
    "COMM_DTYPES",
    "CastAllGather",
    "CastAllReduce",
    "CastReduceScatter",
    "CollectiveHandle",
    "CollectiveTimeoutError",
    "CommLedger",
    "CommRecord",
    "CommTotals",
    "CommWatchdog",
    "FlatAllGather",
    "GatherIntoPlan",
    "GroupPosition",
    "HierarchicalAllGather",
    "HierarchicalGroups",
    "LinkKind",
    "NativeReduceScatter",
    "RankPosition",
    "RanksDivergedError",
    "ReduceOpLike",
    "ReduceScatterHandle",
    "ReduceScatterStrategy",
    "Reduction",
    "StagedReduceScatter",
    "TensorHandle",
    "Topology",
    "WaitRecord",
    "WaitTimings",
    "all_gather_coalesced",
    "all_gather_coalesced_into",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "control_device",
    "group_ranks",
    "has_native_reduce_scatter",
    "hierarchical_all_gather_coalesced",
    "note_collectives",
    "padded_numel",
    "partition_numel",
    "record",
    "reduce_scatter_coalesced",
    "reduce_scatter_coalesced_padded",
    "reduce_scatter_in_place",
    "reduce_scatter_strategy",
    "ring_wire_bytes",
    "served_device_types",
    "wait_polled",
    "shard_range",
    "BOUNDED_DTYPES",
    "GradientBound",
    "BoundedTimeouts",
    "bound_for",
]

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
