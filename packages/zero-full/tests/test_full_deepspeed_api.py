"""``zero_full.deepspeed``: DeepSpeed's entry points and engine members, and the checkpoint options.

The run-for-run comparison with DeepSpeed 0.19.8 itself is in
``integration_tests/test_integration_deepspeed_scripts.py``; here: the launcher error, the
argument parser, the engine's members against their definitions, and the checkpoint
options (client state, LR scheduler, atomic replace, refusal, module-only, mismatch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_full
import zero_full.deepspeed as deepspeed
from zero_full.checkpoint import io as ckpt_io
from zero_full.config.prepare import validate_deepspeed
from zero_testing import raised_message

MICRO = 4


class Small(nn.Module):
    """Odd sizes, a frozen parameter and a buffer; ``extra`` adds a layer (another model)."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(7, 11)
        self.b = nn.Linear(11, 3)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.register_buffer("offset", torch.arange(3, dtype=torch.float32))
        if extra:
            self.c = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x))) + self.frozen[:3] + self.offset
        return ((h - y) ** 2).mean()


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _build(stage: int, extra: bool = False):
    return deepspeed.initialize(
        model=Small(extra),
        config=_config(stage),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )


def _train(engine, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + engine.global_rank)
            loss = engine(torch.randn(MICRO, 7, generator=g), torch.randn(MICRO, 3, generator=g))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> dict[str, torch.Tensor]:
    """The full weights on rank 0 (``{}`` elsewhere)."""
    return {k: v.clone() for k, v in engine.zero_engine.consolidated_state_dict().items()}


def _members_and_checkpoints(rank, root, stage):
    root = Path(root)
    engine, optimizer, loader, scheduler = _build(stage)
    out: dict = {
        "types": [
            type(engine).__name__,
            optimizer is engine.optimizer,
            loader,
            scheduler is engine.lr_scheduler,
        ],
        "sizes": [
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ],
        "ranks": [engine.global_rank, engine.world_size, engine.local_rank, str(engine.device)],
        "precision": [engine.bfloat16_enabled(), engine.fp16_enabled()],
        "boundaries": [],
    }
    engine.backward(engine(torch.zeros(MICRO, 7), torch.zeros(MICRO, 3)))
    out["boundaries"].append(engine.is_gradient_accumulation_boundary())
    engine.step()
    out["boundaries"].append(engine.is_gradient_accumulation_boundary())
    engine.backward(engine(torch.zeros(MICRO, 7), torch.zeros(MICRO, 3)))
    engine.step()
    _train(engine, 1)
    out["after2"] = [
        engine.global_steps,
        engine.global_samples,
        engine.get_lr(),
        engine.was_step_applied(),
        engine.skipped_steps,
        engine.get_global_grad_norm() is not None,
    ]
    engine.save_checkpoint(root, tag="t", client_state={"epoch": 2, "note": "first"})
    first = _weights(engine)
    _train(engine, 1)  # step 3, then the same tag again: replaced
    engine.save_checkpoint(root, tag="t", client_state={"epoch": 3})
    third, third_lr = _weights(engine), engine.get_lr()
    out["refused"] = raised_message(
        zero_full.CheckpointError, engine.zero_engine.save_checkpoint, root, tag="t"
    )
    engine.save_checkpoint(root, tag="side", save_latest=False, exclude_frozen_parameters=True)
    out["listing"] = sorted(p.name for p in root.iterdir())
    out["latest"] = (root / "latest").read_text()
    side = json.loads((root / "side" / ckpt_io.MANIFEST).read_text())
    out["side_params"] = sorted(p["name"] for p in side["params"])
    out["manifest_steps"] = json.loads((root / "t" / ckpt_io.MANIFEST).read_text())["global_steps"]
    continued = _train(engine, 2)
    out["no_first"] = not first or not torch.equal(first["a.weight"], third["a.weight"])  # rank 0 holds them

    resumed, *_ = _build(stage)
    path, client = resumed.load_checkpoint(root)
    out["loaded"] = [
        Path(path).name,
        client,
        resumed.global_steps,
        resumed.get_lr() == third_lr,
        resumed.lr_scheduler.last_epoch,
    ]
    out["same_weights"] = all(torch.equal(v, third[k]) for k, v in _weights(resumed).items())
    out["continued"] = continued == _train(resumed, 2)

    module_only, *_ = _build(stage)
    module_only.load_checkpoint(root, load_module_only=True)
    out["module_only"] = [
        module_only.global_steps,
        module_only.lr_scheduler.last_epoch,
        all(torch.equal(v, third[k]) for k, v in _weights(module_only).items()),
    ]

    out["side_loaded"] = Path(module_only.load_checkpoint(root, tag="side")[0]).name  # frozen: kept

    other, *_ = _build(stage, extra=True)
    before = _weights(other)
    out["mismatch"] = raised_message(zero_full.CheckpointError, other.load_checkpoint, root)
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in _weights(other).items())
    out["lenient"] = other.load_checkpoint(root, load_module_strict=False)[1]
    out["nothing"] = module_only.load_checkpoint(root / "absent")
    out["zero_way"] = raised_message(AttributeError, getattr, engine, "save_16bit_model")
    for e in (engine, resumed, module_only, other):
        e.zero_engine.close()
    return out


@pytest.mark.parametrize("stage", [3])
def test_engine_members_and_checkpoints_have_deepspeeds_meanings(dist, tmp_path, stage):
    res = dist.run(2, _members_and_checkpoints, str(tmp_path), stage, timeout=600)
    for r, out in enumerate(res):
        assert out["types"] == ["DeepSpeedEngine", True, None, True]
        assert out["sizes"] == [2 * MICRO * 2, MICRO, 2]
        assert out["ranks"][:2] == [r, 2] and out["ranks"][3] == "cpu"
        assert out["precision"] == [False, False]
        assert out["boundaries"] == [False, True]
        # 2 optimizer steps, StepLR halves the lr after each applied one
        assert out["after2"] == [2, 2 * 16, [1e-2 / 4], True, 0, True]
        assert "exists already" in out["refused"] and "overwrite=True" in out["refused"]
        assert out["listing"] == ["latest", "side", "t"]  # replaced in place, no temporary left
        assert out["latest"] == "t"  # save_latest=False
        assert out["side_params"] == ["a.bias", "a.weight", "b.bias", "b.weight"]  # frozen left out
        assert out["manifest_steps"] == 3 and out["no_first"]
        assert out["loaded"] == ["t", {"epoch": 3}, 3, True, 3]
        assert out["same_weights"] and out["continued"]
        assert out["module_only"] == [0, 0, True]
        assert "parameter 'c.weight'" in out["mismatch"] and "Nothing was loaded" in out["mismatch"]
        assert out["untouched"] and out["side_loaded"] == "side"
        assert out["lenient"] == {"epoch": 3}
        assert out["nothing"] == (None, None)
        assert "save_pretrained" in out["zero_way"]


def test_init_distributed_without_a_launcher_names_the_command(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    message = raised_message(RuntimeError, deepspeed.init_distributed)
    assert "torchrun --nproc-per-node N script.py" in message and "RANK" in message


def test_add_config_arguments_reads_the_config_path():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale_config) == (True, "ds.json", None)


def test_initialize_refuses_what_zero_does_not_have():
    message = raised_message(ValueError, deepspeed.initialize, model=Small(), config={}, mpu=object())
    assert "mpu" in message and "data-parallel" in message
    message = raised_message(ValueError, deepspeed.initialize, model=Small())
    assert "--deepspeed_config" in message
    both = argparse.Namespace(deepspeed_config="a.json")
    message = raised_message(ValueError, deepspeed.initialize, args=both, model=Small(), config={})
    assert "more than once" in message


def test_activation_checkpointing_recomputes_with_torch_and_refuses_partitioning():
    layer = nn.Linear(5, 5)
    x = torch.randn(3, 5, requires_grad=True)
    deepspeed.checkpointing.configure(None, partition_activations=False)
    deepspeed.checkpointing.checkpoint(lambda t: torch.tanh(layer(t)), x).sum().backward()
    recomputed = (x.grad.clone(), layer.weight.grad.clone())
    x.grad, layer.weight.grad = None, None
    torch.tanh(layer(x)).sum().backward()
    assert torch.equal(recomputed[0], x.grad) and torch.equal(recomputed[1], layer.weight.grad)
    message = raised_message(ValueError, deepspeed.checkpointing.configure, None, partition_activations=True)
    assert "partition_activations" in message and "torch.utils.checkpoint" in message


def test_activation_checkpointing_section_is_read_by_configure_and_reported(tmp_path):
    section = {
        "partition_activations": False,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": section}))
    message = raised_message(ValueError, deepspeed.checkpointing.configure, None, deepspeed_config=str(path))
    assert "activation_checkpointing.cpu_checkpointing" in message
    # an argument overrides the section, as in DeepSpeed; the other keys change no number
    deepspeed.checkpointing.configure(None, deepspeed_config=str(path), checkpoint_in_cpu=False)
    config = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": section}
    _, report = validate_deepspeed(config)
    (finding,) = [f for f in report.findings if f.path == "activation_checkpointing"]
    assert "torch.utils.checkpoint" in finding.why and "zero_full.deepspeed.checkpointing" in finding.why
