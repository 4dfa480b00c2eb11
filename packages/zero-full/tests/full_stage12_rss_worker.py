"""One rank of a fresh-process memory measurement (``test_full_stage12_memory.py``).

Run under ``torch.distributed.run`` with ``MALLOC_MMAP_THRESHOLD_=1048576``:
``python full_stage12_rss_worker.py {ddp|zero1|zero2} OUT.json``. Appends one JSON line per
rank to ``OUT.json``: ``psi`` (parameters), ``rest`` (resident bytes above the runtime's own
after two steps) and ``peak`` (highest resident bytes above the runtime's own during a third
forward + backward + step).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import zero_full

LAYERS, WIDTH, BUCKET = 6, 2048, 1 << 21


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def main(impl: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    base = _status("VmRSS")
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

    step()
    step()
    rest = _status("VmRSS") - base
    _reset_peak()
    step()
    peak = _status("VmHWM") - base
    with open(out, "a", encoding="ascii") as f:
        f.write(json.dumps({"rank": rank, "psi": psi, "rest": rest, "peak": peak}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
