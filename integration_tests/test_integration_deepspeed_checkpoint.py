"""Checkpoints DeepSpeed 0.19.8 wrote (ZeRO stages 1, 2, 3 at world 2, CPU) load into zero at
world 2 and 1 with DeepSpeed's exact fp32 weights and Adam state, and training goes on as in
DeepSpeed; a checkpoint with a missing rank file, an extra file, another model's shapes or a
hostile pickle is refused, naming the culprit, and leaves the model as it was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_full
from zero_full.checkpoint import CheckpointError, is_deepspeed_checkpoint
from zero_full.checkpoint.layout import elementwise_state, local_pieces
from zero_testing import raised_message
from zero_testing.peers import deepspeed_for_training

BATCH = 8
STEPS = 3
TAG = "global_step3"


class Odd(nn.Module):
    """Odd shapes (numel 1, primes), a frozen parameter and a buffer."""

    def __init__(self, wide: int = 13, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(11, wide)
        self.b = nn.Linear(wide, 3)
        self.scale = nn.Parameter(torch.ones(1))
        self.frozen = nn.Parameter(torch.randn(7), requires_grad=False)
        self.register_buffer("offset", torch.arange(5, dtype=torch.float32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x))) * self.scale + self.frozen[:3] + self.offset[:3]
        return ((h - y) ** 2).mean()


def _adam(params):
    params = [p for p in params if p.requires_grad]
    return torch.optim.Adam([{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3}])


def _data(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 11, generator=g), torch.randn(BATCH, 3, generator=g)
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


# --------------------------------------------------------------------------- DeepSpeed's side


def _deepspeed_run(stage: int, root: str) -> dict:
    """Train STEPS steps under DeepSpeed, save, record its full fp32 weights and Adam state, then
    take one more step and record the loss and weights."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed = deepspeed_for_training()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = Odd()
    config = {
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_adam(model.parameters()), config=config)
    for step in range(STEPS):
        engine.backward(engine(*_data(step, rank, 2)))
        engine.step()
    engine.save_checkpoint(root, tag=TAG)
    trained = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if stage < 3:  # DeepSpeed links its per-parameter views of the moments at its first step only
        engine.optimizer._hp_optimizer_states_linked = False  # when they are still empty: relink
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    saved = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in trained}
    moments = {
        n: {k: safe_get_full_optimizer_state(p, k).detach().clone() for k in ("exp_avg", "exp_avg_sq")}
        for n, p in trained
    }
    inner = engine.optimizer.optimizer
    steps = {float(s["step"]) for s in inner.state.values()}
    loss = engine(*_data(STEPS, rank, 2))
    engine.backward(loss)
    engine.step()
    after = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in trained}
    losses = [torch.zeros(()) for _ in range(2)]
    dist.all_gather(losses, loss.detach().reshape(()))
    engine.destroy()
    return {
        "saved": saved,
        "moments": moments,
        "steps": steps,
        "loss": float(sum(losses) / 2),
        "after": after,
    }


@pytest.fixture(scope="module")
def deepspeed_checkpoints(dist, tmp_path_factory):
    """``stage -> (directory, record)``: the checkpoint DeepSpeed wrote and what it recorded
    (each stage run once, when a test first asks for it)."""
    made: dict[int, tuple[Path, dict]] = {}

    def get(stage: int) -> tuple[Path, dict]:
        if stage not in made:
            root = tmp_path_factory.mktemp(f"ds{stage}")
            made[stage] = (root, dist.run(2, _deepspeed_run, stage, str(root), timeout=600)[0])
        return made[stage]

    return get


# --------------------------------------------------------------------------- zero's side


def _full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every trainable parameter's full fp32 master and Adam moments, gathered (every rank)."""
    opt = engine.train_state().optimizer
    out = {}
    for name, piece in local_pieces(engine.module, opt).items():
        if not piece.trainable:
            continue
        group = elementwise_state(opt, piece.optimizer_group)
        local = {"value": piece.padded}
        local.update({k: t.narrow(0, piece.offset, piece.partition_numel) for k, t in group.items()})
        out[name] = {}
        for key, t in local.items():
            if piece.world == 1:
                full = t
            else:
                full = torch.empty(piece.world * piece.partition_numel)
                dist.all_gather_into_tensor(full, t.contiguous(), group=piece.group)
            out[name][key] = full[: piece.numel].view(piece.shape).clone()
    return out


def _zero_resume(stage: int, root: str) -> dict:
    rank = dist.get_rank()
    engine = zero_full.initialize(Odd(seed=99), {"zero_optimization": {"stage": stage}}, _adam)
    engine.load_checkpoint(root)
    loaded = _full_state(engine)
    steps = {float(s["step"]) for s in engine.train_state().optimizer.torch_optimizer.state.values()}
    counters = engine.global_steps
    world = dist.get_world_size()
    loss = engine(*_data(STEPS, rank, world))
    engine.backward(loss)
    engine.step()
    full_loss = loss.detach().clone()
    dist.all_reduce(full_loss)
    after = _full_state(engine)
    engine.close()
    return {
        "loaded": loaded,
        "steps": steps,
        "global_steps": counters,
        "loss": float(full_loss) / world,
        "after": after,
    }


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_checkpoint_loads_exactly_and_training_goes_on(dist, deepspeed_checkpoints, stage, world):
    root, ds = deepspeed_checkpoints(stage)
    assert is_deepspeed_checkpoint(root)
    res = dist.run(world, _zero_resume, stage, str(root), timeout=300)[0]
    assert res["loaded"].keys() == ds["saved"].keys()
    for name, full in res["loaded"].items():
        assert torch.equal(full["value"], ds["saved"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full[key], ds["moments"][name][key]), (name, key)
    assert res["steps"] == ds["steps"] == {float(STEPS)}
    assert res["global_steps"] == STEPS
    # One more step from the same state on the same global batch: DESIGN.md's yardstick.
    assert res["loss"] == pytest.approx(ds["loss"], rel=1e-5)
    for name, full in res["after"].items():
        scale = ds["after"][name].abs().max().clamp_min(1e-12)
        assert float((full["value"] - ds["after"][name]).abs().max() / scale) < 1e-5, name


# --------------------------------------------------------------------------- bad input


def _load_fails(root: str, wide: int) -> tuple[str, bool]:
    engine = zero_full.initialize(Odd(wide=wide, seed=99), {"zero_optimization": {"stage": 2}}, _adam)
    before = engine.consolidated_state_dict()
    msg = raised_message(CheckpointError, engine.load_checkpoint, root)
    after = engine.consolidated_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
    return msg, unchanged


class _Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _broken(kind: str, src: Path, dst: Path) -> str:
    """Copy ``src`` to ``dst`` and break it; returns what the error must name."""
    shutil.copytree(src, dst)
    tag = dst / TAG
    rank1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if kind == "missing":
        (tag / rank1).unlink()
        return rank1
    if kind == "extra":
        (tag / "notes.txt").write_text("stray")
        return "notes.txt"
    if kind == "hostile":
        torch.save({"optimizer_state_dict": _Hostile(str(dst / "pwned"))}, tag / rank1)
        return f"{os.system.__module__}.system"  # posix.system on Linux
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["missing", "extra", "hostile", "other model"])
def test_bad_deepspeed_checkpoint_is_refused_and_nothing_is_loaded(
    dist, deepspeed_checkpoints, tmp_path, kind
):
    src, _ = deepspeed_checkpoints(2)
    if kind == "other model":
        root, culprit, wide = src, "shape mismatch: parameter 'a.weight'", 17
    else:
        root, culprit, wide = tmp_path / "ckpt", None, 13
        culprit = _broken(kind, src, root)
    results = dist.run(2, _load_fails, str(root), wide, timeout=300)
    for msg, unchanged in results:
        assert culprit in msg, msg
        assert unchanged
    if kind == "hostile":
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in results[0][0]
        assert not (root / "pwned").exists()
