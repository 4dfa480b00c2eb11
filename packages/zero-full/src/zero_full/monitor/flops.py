"""``flops_profiler``: one optimizer step's forwards counted with torch's ``FlopCounterMode`` (rank 0)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import zero_params
from zero_full.checkpoint import StepCounters
from zero_full.config.monitoring import FlopsProfilerConfig

__all__ = ["FlopsProfiler"]


class FlopsProfiler:
    """Counts the FLOPs of the forwards of optimizer step ``config.profile_step``."""

    def __init__(self, module: nn.Module, counters: StepCounters, config: FlopsProfilerConfig) -> None:
        self.config = config
        self.counters = counters
        self.module = module
        self.per_module: Counter[str] = Counter()
        self.forwards = 0
        self.seconds = 0.0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count and time the forward run inside, when the engine is at the profiled step."""
        if self.counters.global_steps != self.config.profile_step:
            yield
            return
        mode = FlopCounterMode(display=False)
        start = time.perf_counter()
        with mode:
            yield
        self.seconds += time.perf_counter() - start
        self.forwards += 1
        for name, ops in mode.get_flop_counts().items():
            self.per_module[name] += sum(ops.values())

    def due(self) -> bool:
        """Whether the step just taken was the profiled one (its report is ready)."""
        return self.forwards > 0 and self.counters.global_steps == self.config.profile_step + 1

    def report(self) -> str:
        """The profile of the profiled step's forwards (see the module doc)."""
        fwd = self.per_module.get("Global", 0)
        total = fwd * (3 + self.config.recompute_fwd_factor)
        params = sum(zero_params.full_shape(p).numel() for p in dict.fromkeys(self.module.parameters()))
        per_second = fwd / self.seconds if self.seconds else 0.0
        lines = [
            "-------------------------- zero flops profiler --------------------------",
            f"profile step:                 {self.config.profile_step}",
            f"forwards profiled:            {self.forwards}",
            f"params:                       {params}",
            f"fwd flops (rank 0):           {fwd}",
            f"fwd time (s):                 {self.seconds:.6f}",
            f"fwd FLOPS:                    {per_second:.4g}",
            f"fwd + bwd flops (estimate):   {total:.6g}",
        ]
        if self.config.detailed:
            lines.append("flops per module (torch's FlopCounterMode: matrix products, convolutions):")
            lines += self._modules()
        return "\n".join(lines)

    def _modules(self) -> list[str]:
        depth_of = {name: name.count(".") for name in self.per_module if name != "Global"}
        deepest = max(depth_of.values(), default=-1)
        last = deepest if self.config.module_depth < 0 else min(self.config.module_depth, deepest)
        lines = []
        for depth in range(last + 1):
            level = sorted((n for n, d in depth_of.items() if d == depth), key=lambda n: -self.per_module[n])
            for name in level[: self.config.top_modules]:
                lines.append(f"  depth {depth}: {name}  {self.per_module[name]}")
        return lines
