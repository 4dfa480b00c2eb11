"""Module hooks, execution trace, prefetch and release for ZeRO-3.

:class:`Coordinator` installs forward / backward hooks on a model whose parameters were
partitioned with ``zero_params``: it gathers each module's parameters before it runs,
prefetches the next modules of a recorded :class:`Trace` (its frozen :class:`TracePlan`),
releases parameters after use (never before their gradient reached the
:class:`GradientSink`) and reports :class:`StepStats`. :func:`set_leaf_modules` marks
blocks (mixture of experts) that are gathered as a whole; :func:`granularity_leaves` picks blocks
of small modules by size (``CoordinatorConfig.module_granularity_threshold``);
:func:`coordinated_leaves` is the union a coordinator uses. A :class:`ShardPrefetcher`
(offloaded shards) is asked to swap in the shards of upcoming trace modules ahead of their
gather.
"""

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
