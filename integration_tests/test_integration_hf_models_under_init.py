"""Hugging Face models built under ``zero_full.Init``, then generating under stage 3.

* A GPT-2 and a LLaMA built from their configs inside ``zero_full.Init`` (stage 3, world 1
  and 2): every parameter partitioned, and the consolidated weights equal bit for bit those
  of the whole model built with the same seed — transformers' ``post_init`` weight init
  (``_init_weights`` on each module, after the parameters are partitioned) lands on the shards.
* Greedy ``generate`` inside ``engine.gathered_for_inference()`` gives exactly the tokens of
  the whole model's greedy ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from trainer_models import BUILDERS, token_data

import zero_full
import zero_params

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _built_under_init(kind: str) -> tuple[bool, list[str], bool]:
    """(all partitioned, names whose consolidated weights differ, greedy tokens equal) on rank 0."""
    whole = BUILDERS[kind]()
    with zero_full.Init(config=CONFIG):
        model = BUILDERS[kind]()
    partitioned = all(zero_params.is_partitioned(p) for p in model.parameters())
    engine = zero_full.initialize(model, CONFIG, lambda ps: torch.optim.SGD(ps, lr=0.1))
    try:
        got = engine.consolidated_state_dict()
        prompt = token_data(3)[:, :5]
        with engine.gathered_for_inference():
            tokens = engine.module.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        engine.close()
    expected = whole.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if not got:
        return partitioned, [], torch.equal(tokens, expected)
    bad = [k for k, v in whole.state_dict().items() if k not in got or not torch.equal(got[k], v)]
    return partitioned, bad, torch.equal(tokens, expected)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_built_under_init_has_the_whole_models_weights_and_tokens(dist, world, kind):
    partitioned, bad, same_tokens = dist.run(world, _built_under_init, kind)[0]
    assert partitioned
    assert bad == []
    assert same_tokens
