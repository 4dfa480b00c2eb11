"""``zero_full.cli.train.workloads.GPT2Workload``: the model every caller built by hand, and its batches."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from zero_full.cli.train.workloads import GPT2Workload, enable_hf_checkpointing


def _by_hand(layers: int, hidden: int, heads: int, vocab: int, positions: int) -> GPT2LMHeadModel:
    """The GPT-2 the demo, the benchmarks and the integration tests each built themselves."""
    no_dropout = dict.fromkeys(("attn_pdrop", "resid_pdrop", "embd_pdrop"), 0.0)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        **no_dropout,
        vocab_size=vocab,
        n_positions=positions,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(("seed", "positions"), [(0, None), (5, 23)])
def test_the_model_is_the_hand_built_one_from_the_seed(seed, positions):
    w = GPT2Workload(layers=1, hidden=24, heads=3, vocab=97, seq=11, seed=seed, positions=positions)
    torch.manual_seed(seed)
    want = _by_hand(1, 24, 3, 97, positions or 11)
    torch.manual_seed(seed + 1)  # the builder seeds itself
    got = w.build_model()
    assert _same_weights(got, want)
    assert got.config.n_positions == (positions or 11) and got.config.attn_pdrop == 0.0
    assert got.lm_head.weight is got.transformer.wte.weight  # embeddings tied to the head


def test_without_a_seed_the_model_comes_from_the_callers_rng():
    torch.manual_seed(1234)
    want = _by_hand(2, 16, 4, 31, 8)
    torch.manual_seed(1234)
    got = GPT2Workload(layers=2, hidden=16, heads=4, vocab=31, seq=8, seed=None).build_model()
    assert _same_weights(got, want)


def test_uniform_batches_are_the_seeded_draw_and_differ_by_index():
    w = GPT2Workload(vocab=257, seq=13, seed=3)
    gen = torch.Generator().manual_seed(3 * 1_000_003 + 7)
    assert torch.equal(w.uniform_batch(7, 5), torch.randint(0, 257, (5, 13), generator=gen))
    assert not torch.equal(w.uniform_batch(8, 5), w.uniform_batch(7, 5))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="hidden 30 must be a multiple of heads 4"):
        GPT2Workload(hidden=30, heads=4)
    with pytest.raises(ValueError, match="GPT2Workload.vocab must be >= 2"):
        GPT2Workload(vocab=1)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_checkpointing_recomputes_each_block_with_the_same_gradients_and_no_warning(use_reentrant):
    w = GPT2Workload(layers=2, hidden=24, heads=3, vocab=53, seq=7, seed=3)
    plain, checkpointed = w.build_model(), w.build_model()
    plain.train()
    checkpointed.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers 5 warns on the deprecated spelling
        enable_hf_checkpointing(checkpointed, use_reentrant=use_reentrant)
    calls = [0]
    checkpointed.transformer.h[1].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = w.uniform_batch(0, 3)
    for model in (plain, checkpointed):
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] == 2  # once in the forward, once more when the backward recomputes the block
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_hf_checkpointing_takes_the_older_spelling_and_names_a_model_without_either():
    seen = []

    class Legacy(torch.nn.Module):  # transformers 4.x: gradient_checkpointing_enable only
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            seen.append(gradient_checkpointing_kwargs)

    enable_hf_checkpointing(Legacy(), use_reentrant=True)
    assert seen == [{"use_reentrant": True}]
    with pytest.raises(TypeError, match="Linear has no activation checkpointing"):
        enable_hf_checkpointing(torch.nn.Linear(2, 2), use_reentrant=False)
