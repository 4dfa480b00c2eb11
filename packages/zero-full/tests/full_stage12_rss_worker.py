"""One rank of a fresh-process memory measurement (``test_full_stage12_memory.py``).

:func:`stage12_rank` runs on ranks started by ``zero_launch`` with
``MALLOC_MMAP_THRESHOLD_=1048576`` (fresh processes per implementation: ``ddp``, ``zero1`` or
``zero2``). It returns ``psi`` (parameters), ``rest`` (resident bytes above the runtime's own
after two steps) and ``peak`` (highest resident bytes above the runtime's own during a third
forward + backward + step).
"""

from __future__ import annotations

import torch
from torch import nn

import zero_full
from zero_testing.rss import resident_bytes, rest_and_peak

LAYERS, WIDTH, BUCKET = 6, 2048, 1 << 21


def stage12_rank(ctx, impl: str) -> dict[str, int]:
    """One rank: DDP or zero stage 1 / 2 (``impl``) on a stack of bias-free 2048-wide layers."""
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    base = resident_bytes()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    psi = sum(p.numel() for p in model.parameters())

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-4)

    if impl == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = adamw(ddp.parameters())

        def step() -> None:
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    else:
        zero = {
            "stage": int(impl[-1]),
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "sub_group_size": BUCKET,
        }
        engine = zero_full.initialize(model, {"zero_optimization": zero}, optimizer=adamw)

        def step() -> None:
            engine.backward(engine(x).pow(2).mean())
            engine.step()

    measured = rest_and_peak(step, base)
    if impl != "ddp":
        engine.close()
    return {"psi": psi, "rest": measured.rest, "peak": measured.peak}
