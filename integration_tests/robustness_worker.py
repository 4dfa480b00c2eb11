"""A tiny training run under torchrun that misbehaves on purpose (see test_integration_robustness.py).

``python -m torch.distributed.run --nproc-per-node 2 robustness_worker.py MODE OUT_DIR [CKPT_DIR]``
(``ZERO_ROBUST_STAGE``: the ZeRO stage, 3 by default; ``ZERO_ROBUST_CHECK_PATHS=1``: turn on
``robustness.check_paths``); each rank writes ``OUT_DIR/rank<r>.json`` with what happened
(error type and message, losses, seconds from the start of training to the error).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import zero_full
from zero_full.checkpoint import io as ckpt_io
from zero_testing.models import PathNet

MODE = sys.argv[1]
OUT = sys.argv[2]
CKPT = sys.argv[3] if len(sys.argv) > 3 else ""


def _net(hidden: int) -> PathNet:
    return PathNet(8, hidden, 2)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, object] = {"losses": []}
    config = {
        "zero_optimization": {
            "stage": int(os.environ.get("ZERO_ROBUST_STAGE", "3")),
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "robustness": {
            "comm_timeout": 3,
            "heartbeat_interval": 0.4,
            "check_paths": os.environ.get("ZERO_ROBUST_CHECK_PATHS") == "1",
        },
    }
    start = time.monotonic()
    try:
        engine = zero_full.initialize(_net(33 + (rank if MODE == "hidden" else 0)), config)
        first = 0
        if MODE == "resume":
            engine.load_checkpoint(CKPT)
            first = engine.global_steps
        steps = {"diverge": 3 if rank == 0 else 2}.get(MODE, 4)
        for step in range(first, steps):
            if MODE == "stop" and rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            # "extra": rank 1 calls `mid` once more at step 1 (after the first step recorded the
            # module order); "extra0": already at step 0
            extra = rank == 1 and (MODE, step) in (("extra", 1), ("extra0", 0))
            loss = engine(batch(step, rank), extra=extra)
            engine.backward(loss)
            engine.step()
            report["losses"].append(loss.item())  # type: ignore[union-attr]
            if MODE in ("killsave", "unbroken") and engine.global_steps == 2:
                engine.save_checkpoint(CKPT)
            if MODE == "killsave" and engine.global_steps == 3:
                if rank == 0:  # die in the middle of writing the next checkpoint (rank 0 cleans up otherwise)
                    real = ckpt_io.write_torch

                    def die(obj: object, path: object, real=real) -> None:  # noqa: ANN001
                        real(obj, path)
                        os.kill(os.getpid(), signal.SIGKILL)

                    ckpt_io.write_torch = die
                engine.save_checkpoint(CKPT)
        if MODE == "diverge" and rank == 1:
            # alive (heartbeats go on) but never joins rank 0's third step, until rank 0 has
            # reported its timeout (at most 20 s: the test then fails on rank 0's missing report)
            until = time.monotonic() + 20
            while not os.path.exists(os.path.join(OUT, "rank0.json")) and time.monotonic() < until:
                time.sleep(0.1)
        engine.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report.update(error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - start)
    # written whole, then renamed: torchrun SIGTERMs this rank as soon as its peer dies, and the
    # test must never read a report cut short (an empty rank1.json broke a CI run)
    final = os.path.join(OUT, f"rank{rank}.json")
    with open(final + ".part", "w") as f:
        json.dump(report, f)
    os.replace(final + ".part", final)
    os._exit(0)  # the process group may be wedged after a failed collective


if __name__ == "__main__":
    main()
