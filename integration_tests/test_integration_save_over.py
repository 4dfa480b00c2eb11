"""Saving over an earlier save, and a ``requires_grad`` changed after ``initialize``, at world 2.

* ``engine.save_pretrained`` into a directory that holds an earlier save (single file,
  shards + index, a ``pytorch_model.bin``) leaves exactly the new weight files, and plain
  ``transformers.from_pretrained`` in this process loads the new weights bit for bit (the
  reference: the engine's consolidated fp32 weights).
* Freezing or unfreezing a parameter after ``initialize`` raises on every rank, naming the
  parameter and how to freeze with zero, before anything is computed or stepped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero_full
from zero_full.cli.train.workloads import GPT2Workload
from zero_full.guards.frozen import RequiresGradChangedError
from zero_testing import raised_message

CONFIG = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
}


def _gpt2():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(7)
    return GPT2LMHeadModel(GPT2Workload(layers=1, hidden=16, heads=2, vocab=53, seq=16, seed=None).config())


def _step(engine, step: int) -> None:
    ids = torch.randint(0, 53, (2, 16), generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def _save_twice(out: str, first: str, second: str) -> dict[str, torch.Tensor]:
    with zero_full.initialize(_gpt2(), CONFIG) as engine:
        _step(engine, 0)
        engine.save_pretrained(out, max_shard_size=first)
        if dist.get_rank() == 0:  # an old-style save lying there too
            torch.save({"stale": torch.zeros(1)}, Path(out) / "pytorch_model.bin")
        dist.barrier()
        _step(engine, 1)
        engine.save_pretrained(out, max_shard_size=second)
        return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


@pytest.mark.parametrize(("first", "second"), [("5GB", "8KB"), ("8KB", "5GB"), ("8KB", "12KB")])
def test_save_pretrained_over_an_earlier_save_leaves_exactly_the_new_one(dist, tmp_path, first, second):
    from transformers import GPT2LMHeadModel

    out = tmp_path / "model"
    trained = dist.run(2, _save_twice, str(out), first, second, timeout=600)[0]
    names = sorted(p.name for p in out.iterdir() if "safetensors" in p.name or p.suffix == ".bin")
    if second == "5GB":
        assert names == ["model.safetensors"], names
    else:
        shards = [n for n in names if n.startswith("model-")]
        assert len(shards) > 1 and names == sorted([*shards, "model.safetensors.index.json"]), names
        count = len(shards)
        assert all(n.endswith(f"-of-{count:05d}.safetensors") for n in shards), names
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    loaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    for key, value in trained.items():
        if key in loaded:
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
    assert torch.equal(loaded["transformer.h.0.mlp.c_fc.weight"], trained["transformer.h.0.mlp.c_fc.weight"])


def _freeze_after_initialize() -> tuple[str | None, bool]:
    with zero_full.initialize(_gpt2(), CONFIG) as engine:
        _step(engine, 0)
        before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
        param = dict(engine.module.named_parameters())["transformer.h.0.mlp.c_fc.weight"]
        param.requires_grad_(False)
        message = raised_message(RequiresGradChangedError, _step, engine, 1)
        param.requires_grad_(True)
        after = engine.consolidated_state_dict()
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        return message, unchanged


def _unfreeze_after_initialize() -> tuple[str | None, bool]:
    model = _gpt2()
    frozen = model.transformer.h[0].mlp.c_fc.weight
    frozen.requires_grad_(False)
    with zero_full.initialize(model, CONFIG) as engine:
        _step(engine, 0)
        before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
        dict(engine.module.named_parameters())["transformer.h.0.mlp.c_fc.weight"].requires_grad_(True)
        message = raised_message(RequiresGradChangedError, _step, engine, 1)
        dict(engine.module.named_parameters())["transformer.h.0.mlp.c_fc.weight"].requires_grad_(False)
        after = engine.consolidated_state_dict()
        return message, all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_a_requires_grad_change_after_initialize_is_refused_on_every_rank(dist, change):
    fn = _unfreeze_after_initialize if change == "unfreeze" else _freeze_after_initialize
    word = "unfrozen" if change == "unfreeze" else "frozen"
    for message, unchanged in dist.run(2, fn, timeout=600):
        assert message is not None and f"{word} after initialize: 'transformer.h.0.mlp.c_fc" in message
        assert "Set requires_grad before initialize" in message
        assert unchanged  # nothing was stepped
