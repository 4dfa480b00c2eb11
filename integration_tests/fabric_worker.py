"""Lightning Fabric trainings of a tiny MLP, as a script: ``python fabric_worker.py OUT.json [options]``.

``--stage N`` runs ``Fabric(strategy=ZeroFabricStrategy(...))`` (launch it with ``torchrun
--nproc_per_node 2``); ``--stage 0`` runs the reference: one process, plain torch, the whole
global batch. Rank 0 writes each step's global-batch loss and the final weights to the JSON file.
``--save-at K --ckpt DIR`` saves after step K; ``--resume DIR`` loads it and trains steps K+1...
``OUT1.json [options] --then OUT2.json [options]`` runs several trainings in the same processes.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import zero_params
from zero_testing.scripts import run_each, write_from_rank_0

STEPS = 6
GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 13, 37, 5


def build() -> nn.Module:
    """Odd shapes (partitions split mid-tensor at world 2); weights a pure function of the seed."""
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g))
        for _ in range(STEPS)
    ]


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def reference(args: argparse.Namespace) -> dict:
    model = build()
    opt = optimizer_for(model)
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.tolist() for k, v in model.state_dict().items()}}


def zero(args: argparse.Namespace) -> dict | None:
    from lightning.fabric import Fabric

    from zero_full.lightning.fabric import ZeroFabricStrategy

    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage3_param_persistence_threshold": 0}}
    fabric = Fabric(
        strategy=ZeroFabricStrategy(stage=args.stage, config=config), accelerator="cpu", devices=2
    )
    fabric.launch()
    with fabric.init_module():
        model = build()
    model, opt = fabric.setup(model, optimizer_for(model))
    state = {"model": model, "optimizer": opt, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    rank, world = fabric.global_rank, fabric.world_size
    per_rank = GLOBAL_BATCH // world
    losses = []
    for step, (x, y) in enumerate(batches()):
        if step < state["step"]:
            continue
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        state["step"] = step + 1
        if args.save_at == step + 1:
            fabric.save(args.ckpt, state)
    try:  # zero clips inside engine.step(): the config's gradient_clipping
        fabric.clip_gradients(model, opt, max_norm=1.0)
        clip_refused = ""
    except ValueError as exc:
        clip_refused = str(exc)
    engine = fabric.strategy.engine
    weights = engine.consolidated_state_dict()
    partitioned = all(zero_params.is_partitioned(p) for p in model.parameters())
    if rank != 0:
        return None
    return {
        "losses": losses,
        "weights": {k: v.tolist() for k, v in weights.items()},
        "partitioned": partitioned,
        "stage": engine.config.stage,
        "clip_refused": clip_refused,
    }


def train(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args(argv)
    result = reference(args) if args.stage == 0 else zero(args)
    if result is not None:
        write_from_rank_0(args.out, result)


if __name__ == "__main__":
    run_each(train)
