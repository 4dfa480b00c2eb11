"""Module hooks, execution trace, prefetch and release for ZeRO-3."""

from zero_coord.config import CoordinatorConfig, Phase, TraceState
from zero_coord.coordinator import Coordinator
from zero_coord.hooks import HookSet, ModuleHookState
from zero_coord.leaf import (
    Granularity,
    LeafRegistry,
    coordinated_leaves,
    find_leaf_modules,
    granularity_leaves,
    set_leaf_modules,
)
from zero_coord.prefetch_source import ShardPrefetcher
from zero_coord.sink import GradientSink
from zero_coord.stats import StepStats
from zero_coord.trace import Trace, TraceEvent, TracePlan

__all__ = [
    "Coordinator",
    "CoordinatorConfig",
    "GradientSink",
    "Granularity",
    "HookSet",
    "LeafRegistry",
    "ModuleHookState",
    "Phase",
    "ShardPrefetcher",
    "StepStats",
    "Trace",
    "TraceEvent",
    "TracePlan",
    "TraceState",
    "coordinated_leaves",
    "find_leaf_modules",
    "granularity_leaves",
    "set_leaf_modules",
]
