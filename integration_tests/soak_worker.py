"""Soak run under torchrun: STEPS steps at world 2, a save every EVERY steps, a reload at the end.

``python -m torch.distributed.run --nproc-per-node 2 soak_worker.py OUT_DIR CKPT_DIR STEPS EVERY``;
each rank writes ``OUT_DIR/rank<r>.json``: the losses, the losses of the last EVERY steps re-run
after reloading the checkpoint EVERY steps before the end, and the resident set size (VmRSS)
after the first save and after the last step. Run it with ``MALLOC_MMAP_THRESHOLD_=1048576`` so
freed tensors leave the RSS.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

import zero_full
from zero_testing.models import TanhMLP

OUT, CKPT, STEPS, EVERY = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def _net() -> TanhMLP:
    return TanhMLP(16, 24, 1, names=("inp", "out"))


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def run(
    engine: zero_full.Engine, first: int, last: int, rank: int, rss: dict[str, int], save: bool
) -> list[float]:
    losses = []
    for step in range(first, last):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save and engine.global_steps % EVERY == 0:
            engine.save_checkpoint(CKPT)
        if save and engine.global_steps in (EVERY, STEPS):
            gc.collect()
            rss[str(engine.global_steps)] = rss_kib()
    return losses


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = zero_full.initialize(_net(), config)
    rss: dict[str, int] = {}
    losses = run(engine, 0, STEPS, rank, rss, save=True)
    engine.load_checkpoint(CKPT, tag=f"global_step{STEPS - EVERY}")
    again = run(engine, STEPS - EVERY, STEPS, rank, rss, save=False)
    engine.close()
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "again": again, "rss_kib": rss}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
