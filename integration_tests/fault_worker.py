"""A short stage-3 training at world 2 that fails on purpose, then exits (see test_integration_faults.py).

``python fault_worker.py MODE OUT_DIR CKPT_DIR`` on each rank (spawned with ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, or under torchrun). Every rank trains 4
steps with ``robustness.comm_timeout = 3`` s and saves a checkpoint after step 1; rank 0 then
records the sha256 of every file of it in ``OUT_DIR/saved.json``. At step 2:

* ``stop``: rank 1 SIGSTOPs itself (a process frozen by the OS);
* ``stuck``: rank 1 sleeps 120 s in Python (alive, heartbeats on, never joins);
* ``early``: rank 1 has one batch less: after 3 steps it saves a checkpoint (rank 0 runs step 4);
* ``consolidate``: after step 1 rank 0 alone calls ``engine.consolidated_state_dict()``;
* ``backward``: rank 1's backward raises at step 2; rank 1 catches it and calls ``step()``;
* ``paths_one``: ``robustness.check_paths`` on rank 0 only (fails at ``initialize``);
* ``ok`` / ``noclose`` / ``context``: nothing fails; the engine is closed by ``close()``, not at
  all (the interpreter-exit path) or by leaving ``with initialize(...) as engine``.

Each rank writes ``OUT_DIR/rank<r>.json``: the error (type, message) and ``raised_at`` (the
system's monotonic clock, comparable across processes), and with ``FAULT_DESTROY=1`` how long
``destroy_process_group()`` took. The error is then re-raised: the process exits as Python does
after an uncaught exception, through zero's normal teardown (no ``os._exit``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zero_full

MODE, OUT, CKPT = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 33)
        self.mid = nn.Linear(33, 33)
        self.out = nn.Linear(33, 2)

        self.boom = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.tanh(self.inp(x)))
        if self.boom:  # its backward raises after `out`'s gradients were reduced
            h = _Boom.apply(h)
        return self.out(h).pow(2).mean()


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, h: torch.Tensor) -> torch.Tensor:
        return h.view_as(h)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("a failure in this rank's backward")


CONFIG = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "robustness": {"comm_timeout": 3, "heartbeat_interval": 0.4},
}


def _write(name: str, obj: object) -> None:
    final = OUT / name
    final.with_suffix(".part").write_text(json.dumps(obj))
    os.replace(final.with_suffix(".part"), final)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _train(engine: zero_full.Engine, rank: int, report: dict) -> None:
    steps = STEPS - 1 if (MODE == "early" and rank == 1) else STEPS
    for step in range(steps):
        engine.module.boom = MODE == "backward" and rank == 1 and step == 2
        if step == 2 and rank == 1 and MODE == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == 2 and rank == 1 and MODE == "stuck":
            time.sleep(120)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = engine(x)
        try:
            engine.backward(loss)
        except ValueError:
            if not engine.module.boom:
                raise  # the failure is on purpose only in mode "backward"
        engine.step()
        report["losses"].append(loss.item())
        if engine.global_steps == 1:
            engine.save_checkpoint(CKPT)
            if rank == 0:
                _write("saved.json", _hashes(CKPT))
            if rank == 0 and MODE == "consolidate":
                engine.consolidated_state_dict()
    if MODE == "early" and rank == 1:
        engine.save_checkpoint(CKPT)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict = {"losses": [], "pid": os.getpid()}
    try:
        if MODE == "context":
            with zero_full.initialize(Net(), CONFIG) as engine:
                _train(engine, rank, report)
        else:
            config = CONFIG
            if MODE == "paths_one":
                config = {**CONFIG, "robustness": {**CONFIG["robustness"], "check_paths": rank == 0}}
            engine = zero_full.initialize(Net(), config)
            _train(engine, rank, report)
            if MODE != "noclose":
                engine.close()
    except Exception as exc:
        report.update(error=type(exc).__name__, message=str(exc), raised_at=time.monotonic())
        _write(f"rank{rank}.json", report)
        if os.environ.get("FAULT_DESTROY") == "1":
            start = time.monotonic()
            dist.destroy_process_group()
            report["destroyed_in"] = time.monotonic() - start
            _write(f"rank{rank}.json", report)
        raise
    report["finished_at"] = time.monotonic()
    _write(f"rank{rank}.json", report)
    if os.environ.get("FAULT_DESTROY") == "1":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
