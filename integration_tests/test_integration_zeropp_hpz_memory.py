"""hpZ's memory cost measured from the process: + P/n elements per rank in working precision.

Fresh processes per variant (``zero_launch``, 2 nodes x 2 ranks, ``MALLOC_MMAP_THRESHOLD_=1048576``):
VmRSS at rest after two steps and VmHWM during a third step, above the runtime's own, with and
without ``zero_hpz_partition_size = 2``; the difference is compared with ``zero estimate --hpz 2``
(``StageMemory`` of hpZ minus plain ZeRO-3 = the secondary shard, ``4P/n`` bytes in fp32).

Measured (2 cores, 4 x 1024 x 1024 fp32, SGD): at rest +8.14 to +8.20 MiB per rank against the
estimate's +8.00 MiB; the step peak moved by +4.2 to +12.1 MiB (the peak depends on which gathers
overlap, so only the resting cost is asserted, within 20%).
"""

from __future__ import annotations

import torch
from torch import nn

import zero_full
from zero_full.memory.estimate import estimate_model_states
from zero_testing.rss import resident_bytes, rest_and_peak

LAYERS, WIDTH, WORLD, PER_NODE, HPZ = 4, 1024, 4, 2, 2


def hpz_rank(ctx, hpz: int) -> dict:
    """One rank: resident bytes above the runtime's own at rest and at the step's peak."""
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    base = resident_bytes()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    psi = sum(p.numel() for p in model.parameters())
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_hpz_partition_size": hpz}
    engine = zero_full.initialize(model, {"zero_optimization": zero}, lambda ps: torch.optim.SGD(ps, lr=1e-3))

    def step() -> None:
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    measured = rest_and_peak(step, base)
    engine.close()
    return {"psi": psi, "rest": measured.rest, "peak": measured.peak}


def test_hpz_rss_cost_matches_zero_estimate():
    from zero_launch import launch

    env = {"MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1"}
    runs = {
        hpz: [a.value for a in launch(hpz_rank, WORLD, hpz, timeout=300.0, ranks_per_node=PER_NODE, env=env)]
        for hpz in (1, HPZ)
    }
    psi = runs[1][0]["psi"]
    plain, with_hpz = estimate_model_states(psi, WORLD, "fp32", (3,), hpz_partition_size=HPZ).stages
    formula = with_hpz.total_bytes - plain.total_bytes  # the secondary shard: 4 * psi / n bytes
    for r in range(WORLD):
        rest = runs[HPZ][r]["rest"] - runs[1][r]["rest"]
        peak = runs[HPZ][r]["peak"] - runs[1][r]["peak"]
        mib = {k: (runs[1][r][k] / 2**20, runs[HPZ][r][k] / 2**20) for k in ("rest", "peak")}
        print(
            f"hpZ RSS rank {r}: at rest {mib['rest'][0]:.2f} -> {mib['rest'][1]:.2f} MiB "
            f"(+{rest / 2**20:.2f}), "
            f"step peak {mib['peak'][0]:.2f} -> {mib['peak'][1]:.2f} MiB (+{peak / 2**20:.2f}); "
            f"zero estimate --hpz: +{formula / 2**20:.2f} MiB"
        )
        assert abs(rest - formula) <= 0.2 * formula, (r, rest, formula)
