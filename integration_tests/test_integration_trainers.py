"""zero under the Hugging Face Trainer (``ZeroTrainer``) and PyTorch Lightning (``ZeroStrategy``).

Each run is the worker script launched as a user would: ``torchrun --nproc_per_node 2`` for
zero, plain ``python`` (one process, the whole global batch, no zero) for the reference. The
runs compared with a reference share one launch per trainer and world size (the workers'
``--then``); the resumed runs start in processes of their own, as a user's restart does.

* HF ``Trainer.train`` at stages 2 and 3: per-step losses within 1e-5 of the reference, the
  logged ``learning_rate`` / ``grad_norm`` equal to the engine's, the same eval loss.
* HF: a run stopped at step 4 and resumed from its ``save_strategy`` checkpoint logs steps
  5.. bit for bit; ``save_model`` reloads in plain transformers with identical weights.
* Lightning ``Trainer.fit`` at stages 1, 2, 3: losses within 1e-5 of single-process
  Lightning, the scheduler's rate in the engine; stage 3 also validates.
* Lightning ``Trainer(strategy="zero_stage_3")`` (no config) on a GPT-2 whose matrices exceed the
  default persistence threshold: those split, the rest whole, losses within 1e-5 of the reference.
* Lightning: ``fit(ckpt_path=<ModelCheckpoint of epoch 1>)`` reproduces epoch 2 bit for bit.
* HF at stage 3 on a LLaMA: the same parity as GPT-2.
* HF PEFT LoRA at stage 3: the frozen base sharded, losses within 1e-5 of single-process PEFT,
  the adapter saved in the PEFT format (gathering the adapter only) reloads bit for bit;
  ``trainer.generate`` gives the greedy tokens of plain peft on the saved adapter.
* Lightning ``ZeroStrategy(config=...)`` with optimizer offload, MiCS and ZeRO++ (hpZ + qwZ):
  within 1e-5 of single-process Lightning (2% for the quantized gathers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zero_testing.scripts import run_chained, run_script

HERE = Path(__file__).parent
RTOL = 1e-5


def _run(script: str, out: Path, *args: str, world: int = 2) -> dict:
    run_script(HERE / script, [str(out), *args], world=world, cwd=out.parent)
    return json.loads(out.read_text())


def _run_many(script: str, out_dir: Path, runs: dict[str, list[str]], world: int = 2) -> dict[str, dict]:
    return run_chained(HERE / script, runs, out_dir, world=world)


def _close(a: list[float], b: list[float], rtol: float = RTOL) -> None:
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * max(abs(x), abs(y)), f"step {i}: {x} vs {y}"


def _train_logs(result: dict) -> list[dict]:
    return [e for e in result["log"] if "loss" in e]


LLAMA = ("--model", "llama")
# zero_quantized_nontrainable_weights: the frozen base's shards stored as int8 codes
INT8_BASE = {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_quantized_nontrainable_weights": True}


def _module_dir(name: str):
    """A module-scoped fixture: a fresh directory ``name`` that the runs of this module write to."""

    @pytest.fixture(scope="module")
    def directory(tmp_path_factory) -> Path:
        return tmp_path_factory.mktemp(name)

    return directory


hf_ref_dir = _module_dir("hf_ref")
hf_run_dir = _module_dir("hf_runs")
lightning_run_dir = _module_dir("pl_runs")


@pytest.fixture(scope="module")
def hf_references(hf_ref_dir) -> dict[str, dict]:
    """The single-process references (plain ``Trainer``, the whole global batch), in one launch:
    GPT-2, LLaMA, and PEFT LoRA with its adapter saved."""
    d = hf_ref_dir
    runs = {
        "gpt2": ["--batch", "8", "--output-dir", str(d / "gpt2")],
        "llama": [*LLAMA, "--batch", "8", "--output-dir", str(d / "llama")],
        "lora": ["--lora", "--generate", "--batch", "8", "--output-dir", str(d / "lora"),
                 "--save-model", str(d / "adapter")],
    }  # fmt: skip
    return _run_many("hf_worker.py", d, runs, world=1)


@pytest.fixture(scope="module")
def hf_reference(hf_references) -> dict:
    return hf_references["gpt2"]


@pytest.fixture(scope="module")
def hf_runs(hf_run_dir) -> dict[str, dict]:
    """The world-2 ``ZeroTrainer`` runs compared with the references, in one launch (the stage-3
    run also saves a checkpoint at step 4 and the final model, which the resume test reads)."""
    d = hf_run_dir
    (d / "int8.json").write_text(
        json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": INT8_BASE})
    )
    runs = {
        "stage2": ["--stage", "2", "--output-dir", str(d / "s2")],
        "stage3": ["--stage", "3", "--output-dir", str(d / "s3"), "--save-steps", "4",
                   "--save-model", str(d / "final")],
        "llama": [*LLAMA, "--stage", "3", "--output-dir", str(d / "llama")],
        "lora": ["--lora", "--generate", "--stage", "3", "--output-dir", str(d / "lora"),
                 "--save-model", str(d / "adapter")],
        "lora_int8": ["--lora", "--stage", "3", "--config", str(d / "int8.json"),
                      "--output-dir", str(d / "lora8"), "--save-model", str(d / "adapter8")],
    }  # fmt: skip
    return _run_many("hf_worker.py", d, runs)


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_matches_single_process(stage, hf_reference, hf_runs):
    got = hf_runs[f"stage{stage}"]
    ref, zero = _train_logs(hf_reference), _train_logs(got)
    _close([e["loss"] for e in ref], [e["loss"] for e in zero])
    _close([e["grad_norm"] for e in ref], [e["grad_norm"] for e in zero])
    assert [e["learning_rate"] for e in zero] == [e["learning_rate"] for e in ref]
    # the logged rate and norm are the engine's own
    assert [e["learning_rate"] for e in zero] == [s["lr"] for s in got["engine"]]
    assert [e["grad_norm"] for e in zero] == [s["grad_norm"] for s in got["engine"]]
    _close([hf_reference["eval_loss"]], [got["eval_loss"]])


def test_hf_trainer_llama_at_stage_3_matches_single_process(hf_references, hf_runs):
    """The same check on a LLaMA (grouped-query attention, RMSNorm, rotary embeddings)."""
    ref, got = hf_references["llama"], hf_runs["llama"]
    ref_log, zero_log = _train_logs(ref), _train_logs(got)
    _close([e["loss"] for e in ref_log], [e["loss"] for e in zero_log])
    _close([e["grad_norm"] for e in ref_log], [e["grad_norm"] for e in zero_log])
    assert [e["learning_rate"] for e in zero_log] == [e["learning_rate"] for e in ref_log]
    assert [e["grad_norm"] for e in zero_log] == [s["grad_norm"] for s in got["engine"]]
    _close([ref["eval_loss"]], [got["eval_loss"]])


def test_hf_trainer_resumes_exactly_and_saves_hf_format(tmp_path, hf_runs, hf_run_dir):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    full, run = hf_runs["stage3"], hf_run_dir / "s3"
    resumed = _run(
        "hf_worker.py",
        tmp_path / "res.json",
        "--stage",
        "3",
        "--output-dir",
        str(tmp_path / "run2"),
        "--resume",
        str(run / "checkpoint-4"),
        "--save-model",
        str(tmp_path / "final2"),
    )
    assert [e["loss"] for e in _train_logs(resumed)][4:] == [e["loss"] for e in _train_logs(full)][4:]
    assert [s["grad_norm"] for s in resumed["engine"]] == [s["grad_norm"] for s in full["engine"][4:]]
    saved = load_file(hf_run_dir / "final" / "model.safetensors")
    assert saved.keys() == load_file(tmp_path / "final2" / "model.safetensors").keys()
    for name, t in load_file(tmp_path / "final2" / "model.safetensors").items():
        assert torch.equal(t, saved[name]), name
    model = GPT2LMHeadModel.from_pretrained(hf_run_dir / "final")
    state = model.state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name


WIDE = ("--model", "gpt2_wide", "--validate")


@pytest.fixture(scope="module")
def lightning_references(tmp_path_factory) -> dict[str, dict]:
    """Single-process Lightning (the whole global batch), in one launch: the GPT-2 and the wide GPT-2."""
    runs = {"gpt2": ["--batch", "8", "--validate"], "wide": [*WIDE, "--batch", "8"]}
    return _run_many("lightning_worker.py", tmp_path_factory.mktemp("pl_ref"), runs, world=1)


@pytest.fixture(scope="module")
def lightning_reference(lightning_references) -> dict:
    return lightning_references["gpt2"]


@pytest.fixture(scope="module")
def lightning_runs(lightning_run_dir) -> dict[str, dict]:
    """The world-2 Lightning runs, in one launch: the registered stage names (stage 2 keeping a
    ``ModelCheckpoint`` per epoch in ``ckpts/``, which the resume test reads), the wide GPT-2 at
    ``zero_stage_3``, then ``ZeroStrategy(config=...)`` with each of ``ZERO_CONFIGS``."""
    runs = {
        f"stage{s}": ["--strategy", f"zero_stage_{s}", *(["--validate"] if s == 3 else [])] for s in (1, 2, 3)
    }
    runs["stage2"] += ["--ckpt-dir", str(lightning_run_dir / "ckpts")]
    runs["wide"] = [*WIDE, "--strategy", "zero_stage_3"]
    for setup, (section, _) in ZERO_CONFIGS.items():
        runs[setup] = ["--config", json.dumps({"zero_optimization": section}), "--validate"]
    return _run_many("lightning_worker.py", lightning_run_dir, runs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lightning_fit_matches_single_process(stage, lightning_reference, lightning_runs):
    got = lightning_runs[f"stage{stage}"]
    ref, zero = lightning_reference["records"], got["records"]
    _close([r["loss"] for r in ref], [r["loss"] for r in zero])
    assert [r["lr"] for r in zero] == [r["lr"] for r in ref]
    assert all(r["grad_norm"] > 0 for r in zero)
    assert got["partitioned"] == (stage == 3)  # configure_model ran under zero_full.Init
    if stage == 3:
        _close([lightning_reference["val_loss"]], [got["val_loss"]])


def test_lightning_registered_stage_3_name_splits_by_the_default_threshold(
    lightning_references, lightning_runs
):
    """``Trainer(strategy="zero_stage_3")`` with no config on a GPT-2 whose matrices exceed the
    default persistence threshold (100k elements): those are split, the rest kept whole, and the
    run matches single-process Lightning."""
    ref, got = lightning_references["wide"], lightning_runs["wide"]
    assert got["zero_optimization"]["param_persistence_threshold"] == 100_000
    assert got["partitioned"]
    split, whole = got["split_numels"], got["whole_numels"]
    assert len(split) == 6 and min(split) > 100_000, split  # 2 layers x (c_attn, c_fc, mlp c_proj)
    assert whole and max(whole) <= 100_000, whole
    _close([r["loss"] for r in ref["records"]], [r["loss"] for r in got["records"]])
    assert [r["lr"] for r in got["records"]] == [r["lr"] for r in ref["records"]]
    _close([ref["val_loss"]], [got["val_loss"]])


def test_lightning_resumes_exactly_from_model_checkpoint(tmp_path, lightning_runs, lightning_run_dir):
    full, ckpts = lightning_runs["stage2"], lightning_run_dir / "ckpts"
    first = sorted(ckpts.glob("epoch=0-*.ckpt"))
    assert len(first) == 1 and first[0].is_dir(), list(ckpts.iterdir())
    resumed = _run(
        "lightning_worker.py", tmp_path / "res.json", "--strategy", "zero_stage_2", "--resume", str(first[0])
    )
    epoch = len(full["records"]) // 2
    assert resumed["records"] == full["records"][epoch:]


@pytest.fixture(scope="module")
def lora_reference(hf_references, hf_ref_dir) -> tuple[dict, Path]:
    """Single-process PEFT LoRA training with the plain Trainer: its log and saved adapter."""
    return hf_references["lora"], hf_ref_dir / "adapter"


def test_hf_trainer_lora_on_a_sharded_frozen_base_and_generate(lora_reference, hf_runs, hf_run_dir):
    """PEFT LoRA at stage 3: adapters train, the frozen base stays sharded, the adapter is saved
    in the PEFT format; greedy ``trainer.generate`` equals plain peft's on the saved adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from trainer_models import build_gpt2, token_data

    from zero_testing.compare import max_rel_to_magnitude

    ref, ref_adapter = lora_reference
    got, adapter = hf_runs["lora"], hf_run_dir / "adapter"
    assert got["trainable"] == ref["trainable"] and all(".lora_" in n for n in got["trainable"])
    sharded, frozen = got["frozen_sharded"]
    assert frozen > 0 and sharded == frozen  # the base is sharded, not replicated
    ref_log, zero_log = _train_logs(ref), _train_logs(got)
    _close([e["loss"] for e in ref_log], [e["loss"] for e in zero_log])
    _close([e["grad_norm"] for e in ref_log], [e["grad_norm"] for e in zero_log])
    assert [e["grad_norm"] for e in zero_log] == [s["grad_norm"] for s in got["engine"]]
    trainable, total = got["numel"]
    assert got["save_gathered"] == trainable < total // 10  # save_model gathered the adapter only
    saved = load_file(adapter / "adapter_model.safetensors")
    expected = load_file(ref_adapter / "adapter_model.safetensors")
    assert saved.keys() == expected.keys() and saved
    for name, t in saved.items():  # Adam: parameters compared loosely (see the yardstick)
        assert max_rel_to_magnitude(t, expected[name]) <= 1e-4, name
    # the adapter reloads in plain peft with identical weights; the merged models agree
    plain = PeftModel.from_pretrained(build_gpt2(), adapter).eval()
    state = plain.state_dict()
    for name, t in saved.items():
        key = name.replace(".weight", ".default.weight")
        assert torch.equal(state[key], t), name
    prompt = token_data(3)[:, :5]
    tokens = plain.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got["tokens"] == tokens.tolist()
    merged = plain.merge_and_unload().state_dict()
    reference = PeftModel.from_pretrained(build_gpt2(), ref_adapter)
    merged_ref = reference.merge_and_unload().state_dict()
    for name, t in merged.items():
        assert max_rel_to_magnitude(t, merged_ref[name]) <= 1e-5, name


def test_hf_trainer_lora_with_the_frozen_base_stored_int8(lora_reference, hf_runs, hf_run_dir):
    """``zero_quantized_nontrainable_weights``: the frozen base's shards are int8 codes; LoRA
    training stays within the ZeRO++ tolerance (2%) of single-process PEFT training."""
    got = hf_runs["lora_int8"]
    ref, _ = lora_reference
    int8, frozen = got["frozen_int8"]
    assert frozen > 0 and int8 == frozen, got["frozen_int8"]
    _close([e["loss"] for e in _train_logs(ref)], [e["loss"] for e in _train_logs(got)], 0.02)
    assert (hf_run_dir / "adapter8" / "adapter_model.safetensors").is_file()


SHARD_ALL = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every tensor of the tiny model split
ZERO_CONFIGS = {  # ZeroStrategy(config=...): (the zero_optimization section, loss tolerance)
    "offload": ({**SHARD_ALL, "offload_optimizer": {"device": "cpu"}}, RTOL),
    "mics": ({**SHARD_ALL, "mics_shard_size": 1}, RTOL),
    # quantized gathers (int8 + one scale per block): within the stated ZeRO++ tolerance
    "zeropp": ({**SHARD_ALL, "zero_hpz_partition_size": 1, "zero_quantized_weights": True}, 0.02),
}


@pytest.mark.parametrize("setup", sorted(ZERO_CONFIGS))
def test_lightning_fit_with_a_zero_config(setup, lightning_reference, lightning_runs):
    """MiCS, ZeRO++ and optimizer offload through ``ZeroStrategy(config=...)`` at world 2."""
    section, rtol = ZERO_CONFIGS[setup]
    got = lightning_runs[setup]
    ran = got["zero_optimization"]
    asked = {k.removeprefix("stage3_"): v for k, v in section.items()}  # the engine's own key names
    assert all(ran[k] == v or ran[k] == {**ran[k], **v} for k, v in asked.items()), ran
    assert got["mics"] == (setup == "mics")
    ref, zero = lightning_reference["records"], got["records"]
    _close([r["loss"] for r in ref], [r["loss"] for r in zero], rtol)
    assert [r["lr"] for r in zero] == [r["lr"] for r in ref]
    assert got["partitioned"]
    sharded, total = got["sharded"]
    assert total > 0 and sharded == total  # really split, so teardown and validate meet shards
    _close([lightning_reference["val_loss"]], [got["val_loss"]], rtol)
