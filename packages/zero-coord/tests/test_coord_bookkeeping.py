"""Per-call bookkeeping: what the trace plan fixes is computed once per trace, not in every hook.

Counted, not timed: the Python calls into ``zero_coord`` during one steady-state training step
(``sys.setprofile``), per hooked module. The results stay those of the reference
(``test_coord_correctness``); here the statistics of the counted step must equal an uncounted
one's.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from coord_cases import DeepMLP, ReduceScatterSink, build, coordinate, over_worlds, rank_input

import zero_coord
from zero_coord import CoordinatorConfig

SRC = str(Path(zero_coord.__file__).parent)
DEPTH, WIDTH = 9, 13
# Prefetch on, a live bound that makes release and prefetch evict, reuse within two layers.
CONFIG = CoordinatorConfig(prefetch_bucket_size=400, max_live_parameters=800, max_reuse_distance=400)
# Calls per hooked module and step, world 1: 82 after the split into modules (a call per slot to
# mark or claim it, per event to match it); 62 in the flat coordinator before; 58 with the
# bookkeeping the plan fixes done once per trace; 49 with prefetch windows (a window only once
# half the bucket is free, no generator per trace position or slot list).
MAX_CALLS_PER_MODULE = 52


def _count_calls(rank):
    model, _ = build(DeepMLP, depth=DEPTH, width=WIDTH)
    coord = coordinate(model, CONFIG, ReduceScatterSink())
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(SRC):
            calls[frame.f_code.co_name] += 1

    stats = []
    for step in range(4):
        x = rank_input(step, rank.rank, (3, WIDTH))
        if step == 3:
            sys.setprofile(profile)
        try:
            model(x).pow(2).sum().backward()
        finally:
            sys.setprofile(None)
        stats.append(coord.last_step_stats)
    hooked = coord.hooked_modules
    coord.remove()
    return dict(calls), hooked, stats


@over_worlds
def test_hook_bookkeeping_calls_per_module_and_step(dist, world):
    for calls, hooked, stats in dist.run(world, _count_calls):
        # No Python per module without parameters of its own (the ModuleList): only the root
        # (which starts and ends the step) and the layers get hooks.
        assert hooked == ("", *(f"layers.{i}" for i in range(DEPTH)))
        assert stats[3] == stats[2] and stats[2].prefetch_hits > 0  # counting changed nothing
        total = sum(calls.values())
        assert total <= MAX_CALLS_PER_MODULE * len(hooked), (total / len(hooked), calls)
        # Fixed per trace, not asked per call: no property for "does it prefetch", no plan lookup
        # per matched event, no per-slot marking call for a prefetched batch.
        assert "prefetches" not in calls and "matches" not in calls and "next_use" not in calls
        assert calls["mark_prefetched"] <= calls["_prefetch_gathers"] + calls["settle"]
