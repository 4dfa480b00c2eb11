"""Trainer integrations, without a process group: settings zero cannot honour are refused by name,
``"auto"`` values are filled from the trainer, and ``import zero_full`` stays without them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zero_full.hf.auto import fill_from_training_args
from zero_full.lightning.config import fill_from_trainer, load_raw


def _args(**kw):
    from transformers import TrainingArguments

    base = dict(
        output_dir="unused",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        learning_rate=2e-4,
        weight_decay=0.1,
        max_grad_norm=0.5,
        use_cpu=True,
        report_to=[],
    )
    return TrainingArguments(**{**base, **kw})


def test_import_zero_full_imports_no_trainer_library():
    code = (
        "import sys, zero_full; print(sorted({'lightning', 'transformers', 'accelerate'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_hf_auto_values_come_from_training_args():
    raw = fill_from_training_args(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
            },
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
        },
        _args(),
        world_size=2,
        hidden_size=8,
    )
    assert raw["train_micro_batch_size_per_gpu"] == 3 and raw["gradient_accumulation_steps"] == 2
    assert raw["train_batch_size"] == 12 and raw["gradient_clipping"] == 0.5
    assert raw["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert raw["zero_optimization"]["reduce_bucket_size"] == 64
    from zero_full import ZeroConfig

    assert ZeroConfig.model_validate(raw).resolve_batch(2).train_batch_size == 12


def test_hf_conflicting_value_names_both_settings():
    with pytest.raises(ValueError, match=r"gradient_clipping=2\.0.*max_grad_norm=0\.5"):
        fill_from_training_args({"gradient_clipping": 2.0}, _args(), world_size=1, hidden_size=None)


def test_hf_scheduler_section_is_refused():
    with pytest.raises(ValueError, match="'scheduler' section"):
        fill_from_training_args({"scheduler": {"type": "WarmupLR"}}, _args(), world_size=1, hidden_size=None)


def test_hf_auto_without_a_source_is_a_validation_error_naming_the_key():
    from zero_full import ZeroConfig

    raw = fill_from_training_args(
        {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, _args(), 1, None
    )
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        ZeroConfig.model_validate(raw)


def test_zero_trainer_refuses_auto_find_batch_size():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zero_full.hf_trainer import ZeroTrainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        ZeroTrainer(model=model, args=_args(auto_find_batch_size=True), zero_config={})
    assert torch.is_tensor(next(model.parameters()))


def test_lightning_fill_and_conflicts():
    raw = fill_from_trainer(
        load_raw({"gradient_clipping": "auto"}, 3), accumulate=4, clip_val=1.0, precision_section="bf16"
    )
    assert raw["gradient_accumulation_steps"] == 4 and raw["gradient_clipping"] == 1.0
    assert raw["bf16"] == {"enabled": True} and raw["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match="accumulate_grad_batches=4"):
        fill_from_trainer(
            {"gradient_accumulation_steps": 2}, accumulate=4, clip_val=None, precision_section=None
        )
    with pytest.raises(ValueError, match="fp16.enabled"):
        fill_from_trainer({"fp16": {"enabled": True}}, accumulate=1, clip_val=None, precision_section=None)
    with pytest.raises(ValueError, match="stage=2.*stage is 3"):
        load_raw({"zero_optimization": {"stage": 3}}, 2)


def test_lightning_strategy_names_registered_and_bad_precision_refused():
    from lightning.pytorch.plugins.precision import DoublePrecision
    from lightning.pytorch.strategies import StrategyRegistry

    from zero_full.lightning import ZeroStrategy

    assert {f"zero_stage_{s}" for s in (1, 2, 3)} <= set(StrategyRegistry)
    assert StrategyRegistry["zero_stage_3"]["init_params"] == {"stage": 3}
    strategy = ZeroStrategy(stage=2)
    strategy.precision_plugin = DoublePrecision()
    with pytest.raises(ValueError, match="precision='64-true'"):
        strategy.setup_environment()


def test_zero_trainer_refuses_fsdp_before_the_trainer_acts_on_it():
    from transformers import GPT2Config, GPT2LMHeadModel

    from zero_full.hf_trainer import ZeroTrainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"ZeroTrainer cannot run with TrainingArguments fsdp="):
        ZeroTrainer(model=model, args=_args(fsdp=True), zero_config={})


def test_lightning_second_optimizer_is_refused_naming_the_counts():
    import lightning.pytorch as pl
    import torch

    from zero_full.lightning.strategy import _user_optimizer

    class TwoOptimizers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.automatic_optimization = False  # Lightning itself refuses two optimizers otherwise

        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.a.parameters(), lr=0.1),
                torch.optim.SGD(self.b.parameters(), lr=0.1),
            ]

    module = TwoOptimizers()
    module.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"returned 2 optimizer\(s\) and 0 scheduler\(s\)"):
        _user_optimizer(module)


def test_lightning_clip_by_value_and_auto_without_a_source_are_refused():
    from types import SimpleNamespace

    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

    from zero_full.lightning import ZeroStrategy

    def trainer(algorithm):
        return SimpleNamespace(
            gradient_clip_val=1.0, gradient_clip_algorithm=algorithm, accumulate_grad_batches=1
        )

    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        ZeroStrategy(stage=2).zero_config(trainer(GradClipAlgorithmType.VALUE))
    # Lightning has no hidden size to derive a bucket size from
    strategy = ZeroStrategy(config={"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        strategy.zero_config(trainer(GradClipAlgorithmType.NORM))
    assert ZeroStrategy(stage=3).zero_config(trainer(GradClipAlgorithmType.NORM)).gradient_clipping == 1.0


@pytest.mark.parametrize("kind", ["trainer", "fabric"])
def test_a_strategy_hands_every_ddp_argument_on_and_keeps_the_config(kind):
    from datetime import timedelta

    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.plugins.io import TorchCheckpointIO

    import zero_full.lightning as zl

    if kind == "trainer":
        from lightning.pytorch.accelerators import CPUAccelerator

        cls, built_by = zl.ZeroStrategy, "ZeroStrategy.setup"
    else:
        from lightning.fabric.accelerators import CPUAccelerator

        cls, built_by = zl.ZeroFabricStrategy, "fabric.setup"
    accelerator, env, io = CPUAccelerator(), LightningEnvironment(), TorchCheckpointIO()
    devices = [torch.device("cpu")] * 3
    strategy = cls(
        stage=2,
        config={"zero_optimization": {"stage": "auto"}, "gradient_clipping": 0.5},
        accelerator=accelerator,
        parallel_devices=devices,
        cluster_environment=env,
        checkpoint_io=io,
        process_group_backend="gloo",
        timeout=timedelta(seconds=77),
    )
    assert strategy.accelerator is accelerator and strategy.parallel_devices == devices
    assert strategy.cluster_environment is env and strategy.checkpoint_io is io
    assert strategy._process_group_backend == "gloo" and strategy._timeout == timedelta(seconds=77)
    assert strategy._raw == {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
    with pytest.raises(RuntimeError, match=built_by):
        strategy._require_engine()
